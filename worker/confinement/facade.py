"""The confinement room's one door for the controller: a process confined as a node is, outside any node.

The controller tries the user's code before a run in a node-like sandbox (``controller.sandbox``)
and checks that the user's files lie in the experiment directory (``controller.confs.usercode``).
That is all it takes of ``worker.confinement``, and only through this module:
``tests/unit/test_import_contract.py`` holds the list below (``__all__``) and refuses any other
import of the room from the controller.

- ``Identity``, ``View``: who a confined process is (uid, gid) and what it sees of the file system;
- ``harmless_env``: the environment variables a node's process may inherit from its starter;
- ``python_dirs``: the directories this interpreter needs (to be shown in a ``View``);
- ``under``: whether a path lies under a directory (paths compared, no link followed);
- ``confined_popen``: start a command as an ``Identity`` with a ``View``, with no network;
- ``probe_identity``: a uid and gid of its own for one such command.
"""
from __future__ import annotations

import os
import subprocess
from typing import Any, Sequence

from worker.confinement import confine, fsview, privilege
from worker.confinement.fsview import View, under
from worker.confinement.privilege import python_dirs
from worker.confinement.uids import Identity, probe_identity
from worker.confinement.zygote import harmless_env
from worker.kernel import nsfs

__all__ = ["Identity", "View", "confined_popen", "harmless_env", "probe_identity", "python_dirs", "under"]

CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000


def confined_popen(argv: Sequence[str], popen: dict[str, Any], view: View, ident: Identity) -> subprocess.Popen:
    """Start ``argv`` (``popen``: ``subprocess.Popen``'s keyword arguments) as ``ident`` without
    capabilities, in network, mount and IPC namespaces of its own (no network at all), its
    children in a PID namespace of their own (the first is its pid 1), seeing
    ``view``, under the nodes' rlimits and seccomp filter (``privilege.become_node``), forked by
    the one thread that forks node processes (``privilege.spawn``). Needs root. A ``view``
    that ``ident`` cannot read is a ConfigError naming the path."""
    fsview.check_readable(view, ident)
    ops = fsview.plan_view(view)
    confinement = privilege.Confinement.here()
    rlimits = confine.node_rlimits()
    starter = os.getpid()

    def enter() -> None:  # in the child: system calls only
        if nsfs.libc.unshare(CLONE_NEWNET | CLONE_NEWPID) != 0:
            raise OSError("cannot enter network and PID namespaces of its own")
        privilege.become_node(ident, ops, rlimits, confinement, starter)

    return privilege.spawn(lambda: subprocess.Popen(list(argv), preexec_fn=enter, **popen))
