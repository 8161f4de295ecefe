"""Links changed in place while a run goes on (/update/tc's file, the dashboard's rate change,
a scenario's link steps): the pieces that do not need the run itself."""
from __future__ import annotations

import os

from controller.model.topology import Topology
from worker.api.errors import ConfigError


def links_file(workdir: str, file: str) -> str:
    """The real path of ``file``, a links file inside the experiment directory ``workdir``."""
    root = workdir
    path = os.path.realpath(os.path.join(root, file))
    if os.path.commonpath([root, path]) != root:
        raise ConfigError(f"{file!r} is outside the experiment directory {root}")
    return path


def nodes_only(topology: Topology) -> Topology:
    """``topology``'s nodes without links: what a change of links is read against."""
    declared = Topology()
    for node in topology.nodes.values():
        declared.add_node(node.name, node.kind, node.host, node.cpu, node.mem_bytes, node.ip,
                          uplink=node.uplink_bps, downlink=node.downlink_bps, pids=node.pids_max, python=node.python)
    return declared
