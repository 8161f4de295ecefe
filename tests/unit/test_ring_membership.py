"""A ring's membership alone (``RingMembership``, no role, no model): memberships wired by calls,
forming rings, leaving out the dead, taking back a replacement, refusing bad joins and answers,
and keeping formations and their aborts."""
from __future__ import annotations

import json
import threading
import time
from typing import Any, Optional

import numpy as np
import pytest

from dml_app.roles.ring_membership import (BadJoin, Formation, RingMembership, UnknownFormation, answer_body,
                                           decide)

ORDER = ["r0", "r1", "r2"]


class Events:
    """What a membership writes, in order."""

    def __init__(self) -> None:
        self.written: list[dict[str, Any]] = []

    def write(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, **fields}
        self.written.append(event)
        return event

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.written if e["type"] == kind]


class Net:
    """Memberships reached by name: a join is the destination's ``hold`` (its answer as a node
    encodes it, with a model for a node behind), an abort its ``aborted_by``; a node in ``down``
    neither sends nor answers."""

    def __init__(self) -> None:
        self.nodes: dict[str, RingMembership] = {}
        self.down: set[str] = set()
        self.sent: list[tuple[str, str, str]] = []

    def post_of(self, me: str):
        def post(dest: str, path: str, body: bytes, content_type: str, round_no: int,
                 timeout_s: Optional[float] = None, retries: int = 1) -> Optional[bytes]:
            self.sent.append((me, dest, path))
            if me in self.down or dest in self.down or dest not in self.nodes:
                return None
            target = self.nodes[dest]
            if path == "/ring/abort":
                target.aborted_by(me, json.loads(body)["epoch"])
                return b"{}"
            meta = target.hold(me, json.loads(body))
            return answer_body(dest, meta, [np.full(2, 7.0)] if meta.get("behind") else None, ["w"])
        return post

    def add(self, me: str, life: int = 1, **kw: Any) -> RingMembership:
        settled: list[Formation] = []
        changes: list[list[str]] = []

        def settle(formation: Formation) -> None:  # what a role decides for the formations it makes
            settled.append(formation)
            formation.digest = f"by-{me}"

        m = RingMembership(me, list(ORDER), self.post_of(me), Events(), threading.Event(), sync=5, life=life,
                           step_timeout_s=kw.pop("step_timeout_s", 2.0), join_wait_s=kw.pop("join_wait_s", 1.0),
                           settle=settle, on_change=changes.append, **kw)
        m.settled, m.changes = settled, changes  # type: ignore[attr-defined]
        self.nodes[me] = m
        return m


def form_all(calls: list[tuple[RingMembership, Optional[int]]]) -> dict[str, Any]:
    """``form(want)`` of each membership at once; each one's answer by name."""
    out: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda m=m, w=w: out.__setitem__(m.me, m.form(w)), daemon=True)
               for m, w in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a membership hung"
    return out


def test_decide_a_formation():
    order = ["a", "b", "c", "d"]
    formation, behind = decide(order, "b", 3, 4, {"d": {"want": 3, "epoch": 4}, "a": {"want": None, "epoch": 0}})
    assert formation.members == ["a", "b", "d"] and formation.round == 3 and formation.epoch == 5
    assert behind == {"a"}  # a newcomer gets the ring's model
    formation, behind = decide(order, "a", 2, 7, {"c": {"want": 3, "epoch": 7}})
    assert formation.round == 3 and behind == {"a"} and formation.members == ["a", "c"]  # a redoes a failed round


def test_the_first_live_node_coordinates_and_every_member_gets_its_formation():
    net = Net()
    nodes = [net.add(n) for n in ORDER]
    got = form_all([(m, 1) for m in nodes])
    for m in nodes:
        formation, synced, done = got[m.me]
        assert (formation.epoch, formation.round, formation.members, done, synced) == (1, 1, ORDER, False, None)
        assert formation.digest == "by-r0" and formation.structure is not None and formation.structure.is_ring
        assert m.epoch == 1 and [e["members"] for e in m.events.of("ring_formed")] == [ORDER]
    assert len(nodes[0].settled) == 1 and not nodes[1].settled and not nodes[2].settled  # r0 coordinated


def test_a_dead_member_is_left_out_and_its_replacement_taken_back_with_the_rings_model():
    net = Net()
    r0, r1, r2 = (net.add(n) for n in ORDER)
    form_all([(r0, 1), (r1, 1), (r2, 1)])
    net.down.add("r2")  # r2 dies
    got = form_all([(r0, 2), (r1, 2)])  # r0 waits join_wait_s for r2, then forms without it
    assert got["r0"][0].members == got["r1"][0].members == ["r0", "r1"] and got["r0"][0].epoch == 2
    assert r0.events.of("ring_formed")[-1]["dropped"] == ["r2"] and r0.changes == [["r0", "r1"]]
    net.down.discard("r2")
    replacement = net.add("r2", life=2)  # a replacement joins a running ring before it coordinates
    late = threading.Thread(target=lambda: setattr(replacement, "got", replacement.form(None)), daemon=True)
    late.start()
    deadline = time.monotonic() + 10
    while "r2" not in r0._joins and time.monotonic() < deadline:  # held by the coordinator
        time.sleep(0.01)
    got = form_all([(r0, 3), (r1, 3)])
    late.join(timeout=30)
    formation, synced, done = replacement.got
    assert formation.members == got["r0"][0].members == ORDER and formation.round == 3 and not done
    assert synced is not None and synced[0].tolist() == [7.0, 7.0]  # behind: the coordinator's model
    assert got["r1"][1] is None  # not behind
    assert r1.events.of("ring_formed")[-1]["joined"] == ["r2"]


def test_a_replacement_with_no_ring_to_join_starts_one_and_a_node_whose_elders_are_dead_coordinates():
    replacement = Net().add("r1", life=2, join_wait_s=0.2)
    formation, _, done = replacement.form(None)
    assert formation.members == ["r1"] and formation.epoch == 1 and not done
    net = Net()
    r1 = net.add("r1", join_wait_s=0.2)  # r0 does not answer: r1 is the first live node
    formation, _, _ = r1.form(1)
    assert formation.members == ["r1"] and len(r1.settled) == 1 and ("r1", "r0", "/ring/join") in net.sent


def test_a_finished_node_answers_done():
    net = Net()
    r0, r1 = net.add("r0"), net.add("r1")
    r0.finish()
    formation, synced, done = r1.form(2)
    assert done and formation.round == 6 and synced is None  # (sync + 1: past the last round)
    assert r0.hold("r1", {"want": 2, "epoch": 0}) == {"done": True, "epoch": 0, "round": 6, "members": []}


@pytest.mark.parametrize("body,words", [
    ([1], "a join is a JSON object"),
    ({"want": 0, "epoch": 0}, "a join needs want"),
    ({"want": True, "epoch": 0}, "a join needs want"),
    ({"want": 1, "epoch": -1}, "a join needs want"),
    ({"want": 1, "epoch": 0, "votes": {"0:p": ["yes"]}}, "r1's vote of 0:p: a vote is a JSON object or None")])
def test_a_bad_join_is_refused_and_held_nowhere(body, words):
    r0 = Net().add("r0")
    with pytest.raises(BadJoin, match=words):
        r0.hold("r1", body)
    assert r0._joins == {}


def test_a_formation_answer_with_twice_a_member_or_another_vote_for_this_node_is_not_taken():
    r0 = Net().add("r0")
    r0.votes_out = {"0:adaptive_batch": {"gns": 5.0}}
    good = {"epoch": 1, "round": 1, "members": ["r0", "r1"], "strategy": "binary_tree",
            "votes": {"r0": {"0:adaptive_batch": {"gns": 5.0}}, "r1": {}}, "batch_size": 64}
    assert r0.answered(good).batch_size == 64
    for bad in ({"members": ["r0", "r1", "r1"]}, {"members": ["r1"]}, {"members": ["r0", "r9"]}, {"epoch": "1"},
                {"round": True}, {"strategy": "star:r9"}, {"votes": {"r0": {"0:adaptive_batch": {"gns": 6.0}}}},
                {"votes": {"r2": {}}}, {"votes": {"r0": {"0:adaptive_batch": {"gns": 5.0}}, "r1": {"0:x": [1]}}}):
        assert r0.answered({**good, **bad}) is None, bad


def test_an_abort_counts_from_a_member_only_and_the_others_are_told_once():
    net = Net()
    r0, r1 = net.add("r0"), net.add("r1")
    formation = Formation(3, 1, ["r0", "r1"])
    r0.adopt(formation)
    r0.aborted_by("r2", 3)  # not a member of formation 3
    assert not r0.is_aborted(3)
    r0.aborted_by("r1", 3)
    assert r0.is_aborted(3)
    r0.abort(Formation(4, 1, ["r0", "r1"]), "lost r1")
    r0.abort(Formation(4, 1, ["r0", "r1"]), "lost r1 again")
    assert [s for s in net.sent if s[2] == "/ring/abort"] == [("r0", "r1", "/ring/abort")]
    assert [e["detail"] for e in r0.events.of("ring_aborted")] == ["lost r1", "lost r1 again"]


def test_the_last_formations_are_kept_and_older_ones_are_over():
    r0 = Net().add("r0", step_timeout_s=0.2)
    for epoch in range(1, 6):
        r0.adopt(Formation(epoch, epoch, ["r0", "r1"]))
    assert r0.formation(5).round == 5 and r0.formation(3).round == 3
    with pytest.raises(UnknownFormation, match="formation 2 is over for r0"):
        r0.formation(2)
    with pytest.raises(UnknownFormation, match="r0 is in no ring formation 9"):
        r0.formation(9)  # (after waiting step_timeout_s for it)
    assert [e["epoch"] for e in r0.events.of("ring_formed")] == [1]  # (only when the members change)
