"""Who is in the run: deaths expected and seen, replacements, every node's lives.

Nodes may die on purpose (a scenario's crash or revocation): ``expect`` says so first, and the
node's death is then its ending (``crashed``, ``revoked``...), not a failure. ``replace`` starts a
dead node's role again (same namespace and links, its confs pushed again) so that it rejoins the
running experiment; its ending lists every life (``revoked, replaced, done``). ``rows`` are the
membership changes the controller saw, in order: ``lives.json`` and ``membership.csv`` at the end.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from controller.run.nodes import SETTLED, UNSETTLED, NodeConfs, Nodes, NodeState, State, life_ending
from controller.run.progress import clip
from worker.api.errors import ConfigError

REPLACE_READY_S = 60.0  # how long a replaced node's process may take to answer
MAX_WHY_CHARS = 60  # an expected death's why: the node's ending


def check_why(name: str, why: str) -> str:
    """``why`` with its blanks folded; ConfigError unless it is a few plain words and not an ending."""
    why = " ".join(str(why).split())
    if (not why or len(why) > MAX_WHY_CHARS or why in UNSETTLED + SETTLED
            or not all(c.isalnum() or c in " -_." for c in why)):
        raise ConfigError(f"expect_death({name!r}): the why must be a few words like 'crashed' or 'revoked by "
                          f"the scenario' (letters, digits, spaces, - _ .; at most {MAX_WHY_CHARS}; not an "
                          f"ending such as {', '.join(SETTLED)}), not "
                          f"{clip(why, 80)!r}")
    return why


class Membership:
    """The membership changes of the run over ``nodes`` (``lock``: the run's, held while a
    node's state changes)."""

    def __init__(self, nodes: Nodes, confs: NodeConfs, lock: threading.RLock,
                 progress: Callable[[str], None] = print) -> None:
        self.nodes = nodes
        self.confs = confs
        self.lock = lock
        self.progress = progress
        self.rows: list[dict[str, Any]] = []  # {"t", "node", "type", ...}: deaths expected and seen, replacements

    def record(self, name: str, kind: str, **fields: Any) -> None:
        """A membership change seen by the controller."""
        with self.lock:
            self.rows.append({"t": time.time(), "node": name, "type": kind, **fields})

    def expect(self, node: NodeState, why: str) -> None:
        """``node`` is about to die on purpose: once its process is gone, ``why`` is its ending."""
        node.expected_death = why
        self.record(node.name, "death_expected", why=why, pid=node.pid)

    def died(self, node: NodeState) -> None:
        """``node``'s process is gone, as expected: that is its ending (until a replacement)."""
        with self.lock:
            if node.state != State.RUNNING:
                return
            node.state, node.detail = node.expected_death, ""
        self.record(node.name, "node_died", why=node.expected_death, pid=node.pid)
        self.progress(f"{node.name}: {node.expected_death} (expected); the run goes on without it")

    def claim(self, name: str) -> str:
        """Mark dead node ``name`` pending (the run waits for its new life from now on); its state
        before. ConfigError when it runs and is not about to die, or is being started already."""
        node = self.nodes.node(name)
        with self.lock:
            if node.state == State.RUNNING and not node.expected_death:
                raise ConfigError(f"replace_node({name!r}): the node is running; expect_death and kill it first")
            if node.state == State.PENDING:
                raise ConfigError(f"replace_node({name!r}): the node is being started already")
            old_state = node.state
            node.state = State.PENDING
        return old_state

    def replace(self, name: str, old_state: str) -> dict[str, Any]:
        """Start claimed node ``name``'s role again: a new process in the same namespace with the
        same links, its dataset and structure confs pushed (from memory, as deploy does), then
        started so that it rejoins the running experiment. Returns the new life's account; on a
        failure the node has failed, and the error is raised."""
        nodes, node = self.nodes, self.nodes[name]
        try:
            nodes.stop_process(name)
            if old_state == State.RUNNING:  # its death was expected, the monitor had not seen it yet
                old_state = node.expected_death
            node.lives.append({"pid": node.pid, "started_at": node.started_at,
                               "ended": life_ending(old_state, node.detail), "ended_at": time.time()})
            node.expected_death, node.detail, node.stopped_by, node.log_received = "", "", "", False
            node.dataset_conf = node.structure_conf = False
            nodes.start_process(name)
            nodes.wait_answer(name, REPLACE_READY_S, "replaced node")
            nodes.post(name, "/conf/dataset", self.confs.get(name, "dataset"))
            node.dataset_conf = True
            # (life > 1: a role that keeps a membership, the ring, joins it before it leads anything)
            nodes.post(name, "/conf/structure", {**self.confs.structures()[name], "life": len(node.lives) + 1})
            node.structure_conf = True
            nodes.post(name, "/prepare", {})
            nodes.post(name, "/start", {})
        except BaseException as e:
            node.state, node.detail = State.FAILED, clip(f"replacement failed: {e}")
            self.record(name, "replace_failed", detail=node.detail)
            raise
        node.state = State.RUNNING
        life = len(node.lives) + 1
        self.record(name, "node_replaced", pid=node.pid, life=life)
        self.progress(f"{name}: replaced (life {life}), rejoining the run")
        return {"node": name, "pid": node.pid, "life": life, "lives": [*node.lives]}

    def lives(self) -> dict[str, Any]:
        """Every node's lives (earlier ones, then the current) and the membership changes the
        controller saw (``death_expected``, ``node_died``, ``node_replaced``, ``replace_failed``)."""
        with self.lock:
            return {"version": 1, "events": [*self.rows], "nodes": {
                n.name: [*n.lives, {"pid": n.pid, "started_at": n.started_at,
                                    "ended": n.life_ending if n.settled else None}] for n in self.nodes.values()}}
