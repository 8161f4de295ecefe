"""A ring's membership: who is in the ring for each round, agreed on by its members.

As in KungFu's elastic training, the ring changes at round boundaries only. Before each
all-reduce the ring is *formed*: every node sends ``/ring/join`` (the round it wants, the last
formation it knows, its policies' votes) to the first node of the configured ring order that
answers; that node (the coordinator: nothing central, just the first live node of ``ring``)
waits until the last formation's members have joined, or ``join_wait_s``, and answers them all
with the formation: a number (``epoch``), the round, the members in ring order, and the votes,
strategy and batch size it was decided with. So a node that died is left out of the next ring,
and a replaced one (it joins when it starts) is taken in at the next round boundary; a node
behind the decided round (a replacement, or one whose last round failed) gets the
coordinator's model with the answer, so it starts from the ring's. A node replaced after a
death (``life`` > 1 in its conf) never coordinates before it has joined a formation. A member
that cannot finish a formation aborts it: it tells the others (``/ring/abort``), and the round
is formed and run again without the lost member. Every formation that changes the members is a
``ring_formed`` event (``dropped``, ``joined``); an aborted one is ``ring_aborted``. A node
whose rounds are done answers joins with "done".

``RingMembership`` is one node's side of that protocol. It knows no model and no policy: its
role gives it a way to send (``post``), and decides what a formation it coordinates carries
(``settle``: the strategy, batch size and digest) and what a change of members means to it
(``on_change``). Its condition (``cond``) is notified on every change, so the role's waits for
chunks share it (an abort wakes them).
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from dml_app.policies.contract import MAX_POLICIES, PolicyError, check_vote
from dml_app.reduction import allreduce
from dml_app.roles.shared import parallel
from dml_app.runtime.events import EventLog
from dml_app.runtime.http import JSON
from dml_app.wire import weights as wire

Weights = list[np.ndarray]
Post = Callable[..., Optional[bytes]]  # post(dest, path, body, content_type, round_no, timeout_s=, retries=)
KEEP_FORMATIONS = 3  # the last formations a node keeps (chunks of older ones are refused)


class RingAborted(RuntimeError):
    """The ring lost a member: this formation cannot finish its round."""


class BadJoin(ValueError):
    """A join that is not one (its fields, or its votes)."""


class UnknownFormation(LookupError):
    """A formation this node is not in, or no longer keeps."""


@dataclass
class Formation:
    """One ring: its number, the round it runs, its members in ring order, the strategy they
    all-reduce with, and the members' votes it was decided on."""

    epoch: int
    round: int
    members: list[str]
    strategy: str = allreduce.DEFAULT
    votes: dict[str, Any] = field(default_factory=dict)
    digest: str = ""
    batch_size: Optional[int] = None  # the coordinator's, for a node behind
    structure: Optional[allreduce.Structure] = field(default=None, compare=False, repr=False)  # once adopted

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "round": self.round, "members": self.members, "strategy": self.strategy,
                "digest": self.digest, "votes": self.votes, "batch_size": self.batch_size}


def decide(order: list[str], me: str, my_want: Optional[int], my_epoch: int,
           joins: dict[str, dict[str, Any]]) -> tuple[Formation, set[str]]:
    """The coordinator's formation from the joins it holds: members in ``order``, the round
    the most advanced wants (a newcomer wants none), the next epoch; and who is behind
    (wants less than that round, or none: they get the coordinator's model)."""
    wants = {me: my_want, **{p: j.get("want") for p, j in joins.items()}}
    known = [w for w in wants.values() if isinstance(w, int)]
    round_no = max(known) if known else 1
    epoch = max([my_epoch, *(int(j.get("epoch") or 0) for j in joins.values())]) + 1
    members = [m for m in order if m == me or m in joins]
    behind = {p for p, w in wants.items() if not isinstance(w, int) or w < round_no}
    return Formation(epoch, round_no, members), behind


def checked_votes(votes: Any, who: str) -> dict[str, Any]:
    """One node's votes (policy id -> vote), each checked; PolicyError otherwise."""
    if not isinstance(votes, dict) or len(votes) > MAX_POLICIES:
        raise PolicyError(f"{who}'s votes: an object of at most {MAX_POLICIES} policies' votes")
    return {str(k): check_vote(v, f"{who}'s vote of {k}") for k, v in votes.items()}


def answer_body(sender: str, meta: dict[str, Any], weights: Optional[Weights] = None,
                names: Optional[list[str]] = None) -> bytes:
    """A join's answer on the wire (what ``form`` reads): ``meta`` (``hold``'s answer) and, for a
    node behind, the coordinator's model (``names``: its arrays' names)."""
    return wire.encode(weights or [], {"from": sender, **meta}, names if weights else None)


class RingMembership:
    """One node's side of the ring's formations: it joins (``form``), holds the joins of others
    while it coordinates (``hold``), keeps the formations it is in and their aborts."""

    def __init__(self, me: str, order: list[str], post: Post, events: EventLog, stop: threading.Event, *,
                 sync: int, life: int = 1, step_timeout_s: float = 120.0, join_wait_s: float = 30.0,
                 sites: Optional[dict[str, str]] = None, spec: Optional[wire.Spec] = None,
                 settle: Callable[[Formation], None] = lambda formation: None,
                 on_change: Callable[[list[str]], None] = lambda members: None) -> None:
        self.me, self.order, self.post, self.events, self.stop = me, order, post, events, stop
        self.sync, self.life = sync, life  # the rounds of the run; this node's life (> 1: a replacement)
        self.step_timeout_s, self.join_wait_s = step_timeout_s, join_wait_s
        self.sites = sites or {}  # member -> site, for the structures (site_tree)
        self.spec = spec  # what a model sent to a node behind must look like (None: no check)
        self.settle, self.on_change = settle, on_change
        self.members: list[str] = list(order)  # of the last formation this node was in
        self.epoch = 0  # of the last formation this node adopted
        self.votes_out: dict[str, Any] = {}  # this node's votes on its last round, sent with its next join
        self.finished = False  # the rounds are done: joins are answered "done"
        self.cond = threading.Condition()
        self._formations: dict[int, Formation] = {}
        self._aborted: set[int] = set()
        self._joins: dict[str, dict[str, Any]] = {}  # held joins: peer -> {"want", "epoch", "votes"}
        self._answers: dict[str, tuple[Formation, bool]] = {}  # peer -> (formation, behind)
        self._redirect: set[str] = set()

    def hold_s(self) -> float:
        """How long a join may be held: a member may still be training, then the wait."""
        return self.step_timeout_s + self.join_wait_s

    # a peer's join, held ---------------------------------------------------------------------
    def hold(self, peer: str, body: Any) -> dict[str, Any]:
        """``peer``'s join (``body``, as its JSON), held until this node forms the ring, or learns
        another coordinates; the answer's meta: the formation and whether ``peer`` is behind (it
        gets the model), ``redirect``, or ``done``. ``BadJoin`` for a join that is not one."""
        if not isinstance(body, dict):
            raise BadJoin("a join is a JSON object")
        want, epoch, votes = body.get("want"), body.get("epoch", 0), body.get("votes") or {}
        if want is not None and (not isinstance(want, int) or isinstance(want, bool) or want < 1) \
                or not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise BadJoin("a join needs want (a round or null) and epoch (a whole number)")
        try:
            votes = checked_votes(votes, peer)
        except PolicyError as e:
            raise BadJoin(str(e)) from None
        with self.cond:
            if self.finished:
                return {"done": True, "epoch": self.epoch, "round": self.sync + 1, "members": []}
            self._redirect.discard(peer)
            self._answers.pop(peer, None)
            self._joins[peer] = {"want": want, "epoch": epoch, "votes": votes}
            self.cond.notify_all()
            self.cond.wait_for(lambda: peer in self._answers or peer in self._redirect or self.finished,
                               timeout=self.hold_s())
            answer = self._answers.pop(peer, None)
            if answer is None:
                self._joins.pop(peer, None)
                self._redirect.discard(peer)
                return {"redirect": True, "done": self.finished}
        formation, behind = answer
        return {**formation.to_dict(), "behind": behind}

    # this node's join ------------------------------------------------------------------------
    def form(self, want: Optional[int]) -> tuple[Formation, Optional[Weights], bool]:
        """(formation, the coordinator's model when this node is behind, done): join the first
        node of the ring order that answers, or coordinate when none before this one does."""
        for cand in self.order:
            if cand == self.me:
                if self.life > 1 and self.epoch == 0:
                    continue  # a replacement joins a running ring first
                return self._coordinate(want) + (False,)
            body = json.dumps({"want": want, "epoch": self.epoch, "votes": self.votes_out}).encode()
            answer = self.post(cand, "/ring/join", body, JSON, want or 0, timeout_s=self.hold_s() + 10, retries=0)
            if answer is None:
                continue
            try:
                arrays, meta = wire.decode(answer)
            except wire.WeightsFormatError:
                continue
            if meta.get("done"):
                return Formation(self.epoch, self.sync + 1, []), None, True
            if meta.get("redirect"):
                continue
            formation = self.answered(meta)
            if formation is None:
                continue
            if arrays and self.spec is not None and wire.problem(arrays, self.spec):
                arrays = []
            self.adopt(formation)
            with self.cond:  # joins held here go to that coordinator
                self._redirect.update(self._joins)
                self.cond.notify_all()
            return formation, (arrays or None) if meta.get("behind") else None, False
        if self.life > 1 and self.epoch == 0:  # no ring to join: the replacement starts one
            return self._coordinate(want) + (False,)
        raise RingAborted("no node of the ring answered")

    def answered(self, meta: dict[str, Any]) -> Optional[Formation]:
        """The formation a coordinator answered with, when it is one this node can be in: whole
        numbers, members of the ring once each (this node among them), a strategy over them, every
        vote a member's and checked, this node's own vote as it sent it; else None."""
        members, epoch, round_no = meta.get("members"), meta.get("epoch"), meta.get("round")
        if not isinstance(members, list) or self.me not in members or len(set(members)) != len(members) \
                or any(m not in self.order for m in members):
            return None
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2 ** 62 for x in (epoch, round_no)):
            return None
        batch = meta.get("batch_size")
        try:
            strategy = str(meta.get("strategy") or allreduce.DEFAULT)
            allreduce.parse(strategy, self.order)
            allreduce.build(strategy, members, self.sites)
            raw = meta.get("votes") or {}
            if not isinstance(raw, dict) or not set(raw) <= set(members):
                raise PolicyError("the votes of a formation are its members'")
            votes = {m: checked_votes(v, m) for m, v in raw.items()}
            if votes.get(self.me, {}) != self.votes_out:
                raise PolicyError("the formation does not carry this node's vote as it sent it")
        except (allreduce.StructureError, PolicyError):
            return None
        return Formation(epoch, round_no, list(members), strategy, votes, str(meta.get("digest", ""))[:64],
                         batch if isinstance(batch, int) and not isinstance(batch, bool) and 0 < batch <= 2 ** 20
                         else None)

    def _coordinate(self, want: Optional[int]) -> tuple[Formation, Optional[Weights]]:
        expected = set(self.members) - {self.me}
        with self.cond:
            self.cond.wait_for(lambda: expected <= set(self._joins) or self.stop.is_set(), timeout=self.join_wait_s)
            joins = dict(self._joins)
        formation, behind = decide(self.order, self.me, want, self.epoch, joins)
        formation.votes = {m: (self.votes_out if m == self.me else joins[m].get("votes") or {})
                           for m in formation.members}
        self.settle(formation)  # (outside the lock: a user's policy may take its time)
        with self.cond:
            for peer in joins:
                self._answers[peer] = (formation, peer in behind)
                if self._joins.get(peer) is joins[peer]:
                    del self._joins[peer]
            self.cond.notify_all()
        self.adopt(formation)
        return formation, None

    def adopt(self, formation: Formation) -> None:
        """Take ``formation`` as this node's ring (its ``structure`` built); a ``ring_formed``
        event when its members changed."""
        before = self.members
        formation.structure = allreduce.build(formation.strategy, formation.members, self.sites)
        with self.cond:
            self._formations[formation.epoch] = formation
            for old in [e for e in self._formations if e <= formation.epoch - KEEP_FORMATIONS]:
                del self._formations[old]
            self.epoch = max(self.epoch, formation.epoch)
            self.cond.notify_all()
        self.members = list(formation.members)
        if self.members != before:
            self.on_change(list(self.members))
        if self.members != before or self.epoch == formation.epoch == 1:
            self.events.write("ring_formed", round=formation.round, epoch=formation.epoch,
                              members=formation.members, dropped=[m for m in before if m not in formation.members],
                              joined=[m for m in formation.members if m not in before])

    # formations kept, and aborted ------------------------------------------------------------
    def formation(self, epoch: int) -> Formation:
        """Formation ``epoch`` as this node knows it (waiting a little: a chunk may come just
        before the join's answer); ``UnknownFormation`` when this node is in none of that epoch."""
        with self.cond:
            if epoch not in self._formations and epoch <= self.epoch - KEEP_FORMATIONS + 1:
                raise UnknownFormation(f"formation {epoch} is over for {self.me}")
            if not self.cond.wait_for(lambda: epoch in self._formations, timeout=self.step_timeout_s):
                raise UnknownFormation(f"{self.me} is in no ring formation {epoch}")
            return self._formations[epoch]

    def is_aborted(self, epoch: int) -> bool:
        with self.cond:
            return epoch in self._aborted

    def aborted_by(self, peer: str, epoch: int) -> None:
        """``peer`` could not finish formation ``epoch``: it is aborted, when ``peer`` is one of its members."""
        with self.cond:
            formation = self._formations.get(epoch)
            if formation is not None and peer in formation.members:
                self._aborted.add(epoch)
                self.cond.notify_all()

    def abort(self, formation: Formation, why: str) -> None:
        """This node cannot finish ``formation``: a ``ring_aborted`` event, and (the first time)
        the other members told."""
        with self.cond:
            first = formation.epoch not in self._aborted
            self._aborted.add(formation.epoch)
        self.events.write("ring_aborted", round=formation.round, epoch=formation.epoch, detail=why)
        if first:
            body = json.dumps({"epoch": formation.epoch}).encode()
            parallel(lambda m: self.post(m, "/ring/abort", body, JSON, formation.round, timeout_s=5, retries=0),
                     [m for m in formation.members if m != self.me])

    def finish(self) -> None:
        """The rounds are done: answer the joins held here (and those to come) with "done"."""
        with self.cond:
            self.finished = True
            self.cond.notify_all()
