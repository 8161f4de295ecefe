"""Ring all-reduce with elastic membership: every node trains, then the ring averages
the models of that round's members exactly.

The weights are flattened into one vector and cut with ``np.array_split`` into
one chunk per member (a layer smaller than the ring is no special case: every
element is in some chunk). Reduce-scatter: in n - 1 steps each member passes a
partial sum on to its successor and adds what its predecessor passed it, so
each ends up owning the full sum of one chunk, which it divides by n.
All-gather: n - 1 more steps pass the finished chunks around. Partial sums
travel as float64 and finished chunks in the model's dtype, so the result is
the elementwise mean of the members' models, rounded once.

Membership (as KungFu's elastic training: the ring changes at round
boundaries only). Before each all-reduce the ring is *formed*: every node sends
``/ring/join`` (the round it wants, the last formation it knows) to the first
node of the configured ring order that answers; that node (the coordinator:
nothing central, just the first live node of ``ring``) waits until the last
formation's members have joined, or ``join_wait_s``, and answers them all with
the formation: a number (``epoch``), the round, and the members in ring order.
So a node that died is left out of the next ring, and a replaced one (it joins
when it starts) is taken in at the next round boundary; a node behind the
decided round (a replacement, or one whose last round failed) gets the
coordinator's model with the answer, so it starts from the ring's. A node
replaced after a death (``life`` > 1 in its conf) never coordinates before it
has joined a formation. A step that fails (a member died mid-round) aborts the
formation: the node tells the others (``/ring/abort``), and the round is formed
and run again without the lost member. Every formation that changes the
members is a ``ring_formed`` event (``dropped``, ``joined``); an aborted one is
``ring_aborted``. A node whose rounds are done answers joins with "done".

Strategies (``dml_app.reduction.allreduce``): the conf's ``strategy`` (``ring`` by default) may be a
tree instead, ``star:<node>``, ``binary_tree`` or ``site_tree``: each member adds its
children's partial sums (float64) to its own model and sends the sum up; the root divides
by the member count, rounds once, and the mean goes back down. Every formation carries its
strategy and the structure's digest.

Adaptation (``dml_app.policies``): after a round, this node's policies vote; the votes go
with the next join, and the formation's answer carries every member's, so each member runs
the same decisions on the same votes. The coordinator puts the strategy it decided in the
formation; a member whose own decision has another digest refuses the formation (it is
aborted). A strategy that changes is a ``strategy_changed`` event. Monitors: each round
event has the ring's ``strategy``, ``cluster_size``, ``comm_goodput_bps`` (the model's
bytes over the time of this node's all-reduce), ``gns`` (``dml_app.policies.monitors``) and, every
``monitor_every`` rounds, ``grad_var``; ``monitor_s`` is what computing them took.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import numpy as np

from dml_app.reduction import allreduce
from dml_app.reduction.allreduce import chunk_index, join, split
from dml_app.wire import weights as wire
from dml_app.runtime.http import JSON, HttpError, Request, Response
from dml_app.policies.contract import MAX_POLICIES, PolicyError, check_vote
from dml_app.policies.monitors import NoiseScale, delta, grad_var
from dml_app.roles.base import Context, Role, RoundRecord, Weights, ok
from dml_app.roles.shared import parallel

MAX_ABORTS = 5  # formations of one round that may fail in a row before the node gives up
KEEP_FORMATIONS = 3  # the last formations a node keeps (chunks of older ones are refused)


class RingAborted(RuntimeError):
    """The ring lost a member: this formation cannot finish its round."""


class StrategyRefused(RingAborted):
    """This node decided another structure than the formation's (a different digest)."""


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


class RingRole(Role):
    name = "ring"
    ROUTES = (("POST", "/ring/chunk"), ("POST", "/ring/join"), ("POST", "/ring/abort"))
    SMALL_ROUTES = frozenset({"/ring/abort"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.order: list[str] = list(ctx.conf["ring"])
        self.ring = self.order  # (the configured ring)
        self.members: list[str] = list(self.order)  # of the last formation this node was in
        self.epoch = 0
        self.life = int(ctx.conf.get("life", 1))
        self.elements = 0 if self.spec is None else sum(int(np.prod(s)) for s, _ in self.spec)
        self.step_timeout_s = float(ctx.conf.get("step_timeout_s", 120.0))
        self.join_wait_s = float(ctx.conf.get("join_wait_s", 30.0))
        self.want: Optional[int] = None if self.life > 1 else 1  # the round to form next (None: a newcomer's)
        self.over = False  # the ring ran its last round (or is done)
        self.aborts = 0  # formations of round ``want`` that failed in a row
        self._formations: dict[int, Formation] = {}
        self._aborted: set[int] = set()
        self._arrived: dict[tuple[int, str, int], tuple[str, np.ndarray]] = {}
        self._joins: dict[str, dict[str, Any]] = {}  # held joins: peer -> {"want", "epoch"}
        self._answers: dict[str, tuple[Formation, bool]] = {}  # peer -> (formation, behind)
        self._redirect: set[str] = set()
        self._cond = threading.Condition()
        self.strategy = str(ctx.conf.get("strategy") or allreduce.DEFAULT)  # the one decided for the next formation
        allreduce.parse(self.strategy, self.order)
        self.sites: dict[str, str] = {str(k): str(v) for k, v in (ctx.conf.get("sites") or {}).items()}
        self.installed = self.strategy  # the strategy of the last formation this node ran
        self.reason = "the structure file's"  # why ``strategy`` is what it is
        self._structures: dict[int, allreduce.Structure] = {}
        self.votes_out: dict[str, Any] = {}  # this node's votes on its last round, sent with its next join
        self.noise = NoiseScale()
        self.monitor_every = int(ctx.conf.get("monitor_every", 0))
        self._sends: dict[str, list[float]] = {}  # peer -> [bytes, seconds] of this round's all-reduce sends
        # the last round whose votes this node decided on, and what to restore if its formation aborts
        self._decided: tuple[int, Optional[list[dict[str, Any]]], str, str, int] = (0, None, self.strategy, "",
                                                                                     self.batch_size)
        self.view.strategy, self.view.members = self.strategy, list(self.order)

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/ring/chunk"): self.on_chunk, ("POST", "/ring/join"): self.on_join,
                ("POST", "/ring/abort"): self.on_abort}

    # membership ------------------------------------------------------------------------------
    def hold_s(self) -> float:
        """How long a join may be held: a member may still be training, then the wait."""
        return self.step_timeout_s + self.join_wait_s

    def on_join(self, req: Request) -> Response:
        """A node's join: held until this node forms the ring (then the formation, with the
        model for one behind), or learns another coordinates (``redirect``)."""
        peer = self.require_sender(req, self.order, "a join")
        body = req.json()
        if not isinstance(body, dict):
            raise HttpError(400, "bad_join", "a join is a JSON object")
        want, epoch, votes = body.get("want"), body.get("epoch", 0), body.get("votes") or {}
        if want is not None and (not isinstance(want, int) or isinstance(want, bool) or want < 1) \
                or not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            raise HttpError(400, "bad_join", "a join needs want (a round or null) and epoch (a whole number)")
        try:
            votes = checked_votes(votes, peer)
        except PolicyError as e:
            raise HttpError(400, "bad_join", str(e)) from None
        with self._cond:
            if self.finished:
                return self._answer(req, {"done": True, "epoch": self.epoch, "round": self.sync + 1,
                                          "members": []})
            self._redirect.discard(peer)
            self._answers.pop(peer, None)
            self._joins[peer] = {"want": want, "epoch": epoch, "votes": votes}
            self._cond.notify_all()
            self._cond.wait_for(lambda: peer in self._answers or peer in self._redirect or self.finished,
                                timeout=self.hold_s())
            answer = self._answers.pop(peer, None)
            if answer is None:
                self._joins.pop(peer, None)
            if answer is None:
                self._redirect.discard(peer)
                return self._answer(req, {"redirect": True, "done": self.finished})
        formation, behind = answer
        # through the compute thread: never a copy taken half-way through a training step
        weights = self.ctx.compute(self.ctx.model.get_weights) if behind and self.ctx.model is not None else []
        return self._answer(req, {**formation.to_dict(), "behind": behind}, weights)

    def _answer(self, req: Request, meta: dict[str, Any], weights: Optional[Weights] = None) -> Response:
        body = wire.encode(weights or [], {"from": self.ctx.name, **meta}, self.weight_names if weights else None)
        if weights:  # a model for a node behind (a formation alone is a small reply on its connection)
            self.count_sent_answer(req, body)
        return 200, wire.CONTENT_TYPE, body

    def form(self, want: Optional[int]) -> tuple[Formation, Optional[Weights], bool]:
        """(formation, the coordinator's model when this node is behind, done): join the first
        node of the ring order that answers, or coordinate when none before this one does."""
        for cand in self.order:
            if cand == self.ctx.name:
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
            formation = self._answered(meta)
            if formation is None:
                continue
            if arrays and self.spec is not None and wire.problem(arrays, self.spec):
                arrays = []
            self._adopt(formation)
            with self._cond:  # joins held here go to that coordinator
                self._redirect.update(self._joins)
                self._cond.notify_all()
            return formation, (arrays or None) if meta.get("behind") else None, False
        if self.life > 1 and self.epoch == 0:  # no ring to join: the replacement starts one
            return self._coordinate(want) + (False,)
        raise RingAborted("no node of the ring answered")

    def _answered(self, meta: dict[str, Any]) -> Optional[Formation]:
        """The formation a coordinator answered with, when it is one this node can be in: whole
        numbers, members of the ring once each (this node among them), a strategy over them, every
        vote a member's and checked, this node's own vote as it sent it; else None."""
        members, epoch, round_no = meta.get("members"), meta.get("epoch"), meta.get("round")
        if not isinstance(members, list) or self.ctx.name not in members or len(set(members)) != len(members) \
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
            if votes.get(self.ctx.name, {}) != self.votes_out:
                raise PolicyError("the formation does not carry this node's vote as it sent it")
        except (allreduce.StructureError, PolicyError):
            return None
        return Formation(epoch, round_no, list(members), strategy, votes, str(meta.get("digest", ""))[:64],
                         batch if isinstance(batch, int) and not isinstance(batch, bool) and 0 < batch <= 2 ** 20
                         else None)

    def _coordinate(self, want: Optional[int]) -> tuple[Formation, Optional[Weights]]:
        expected = set(self.members) - {self.ctx.name}
        with self._cond:
            self._cond.wait_for(lambda: expected <= set(self._joins) or self.ctx.stop.is_set(),
                                timeout=self.join_wait_s)
            joins = dict(self._joins)
        formation, behind = decide(self.order, self.ctx.name, want, self.epoch, joins)
        formation.votes = {m: (self.votes_out if m == self.ctx.name else joins[m].get("votes") or {})
                           for m in formation.members}
        self._decide(formation)  # (outside the lock: a user's policy may take its time)
        formation.strategy, formation.batch_size = self.strategy, self.batch_size
        formation.digest = allreduce.build(self.strategy, formation.members, self.sites).digest()
        with self._cond:
            for peer in joins:
                self._answers[peer] = (formation, peer in behind)
                if self._joins.get(peer) is joins[peer]:
                    del self._joins[peer]
            self._cond.notify_all()
        self._adopt(formation)
        return formation, None

    def _decide(self, formation: Formation) -> None:
        """The policies' decisions on the formation's votes (every member runs the same), once per
        round: the state before is kept, to be restored (``undo``) when the formation aborts."""
        if not self.policies or formation.round <= self._decided[0]:
            return
        self._decided = (formation.round, self.policies.snapshot(), self.strategy, self.reason, self.batch_size)
        if any(formation.votes.values()):
            self.view.members = list(formation.members)
            self.policies.decide(formation.round, formation.votes, list(formation.members))

    def undo(self, formation: Formation) -> None:
        """The formation aborted: its round's decisions are taken again with the next one's votes."""
        round_no, states, strategy, reason, batch = self._decided
        if round_no == formation.round and states is not None:
            self.policies.restore(states)
            self.strategy, self.reason = strategy, reason
            self.batch_size = self.view.batch_size = batch
            self.view.strategy = strategy
            self._decided = (round_no - 1, None, strategy, reason, batch)

    def apply(self, action: dict[str, Any]) -> None:
        """A policy's action: the batch size, or the strategy of the formations to come."""
        super().apply(action)
        if "strategy" in action:
            allreduce.parse(action["strategy"], self.order)
            self.strategy = self.view.strategy = str(action["strategy"])
            self.reason = str(action.get("reason") or "a policy's decision")

    def install(self, formation: Formation, behind: bool) -> None:
        """Agree on the formation's structure: a node behind takes it; the others decide on its
        votes and refuse (``StrategyRefused``) when their structure has another digest."""
        if behind:
            self.strategy = self.view.strategy = formation.strategy
            if formation.batch_size:
                self.batch_size = self.view.batch_size = formation.batch_size
        else:
            self._decide(formation)  # (once a round: the coordinator decided when it made the formation)
        structure = self._structures[formation.epoch]  # (built from the formation's strategy by _adopt)
        if self.strategy != formation.strategy or structure.digest() != formation.digest:
            mine = allreduce.build(self.strategy, formation.members, self.sites).digest()
            self.ctx.events.write("strategy_refused", round=formation.round, epoch=formation.epoch,
                                  strategy=self.strategy, formation_strategy=formation.strategy,
                                  digest=mine, formation_digest=formation.digest)
            raise StrategyRefused(f"formation {formation.epoch} uses {formation.strategy} "
                                  f"({formation.digest}); this node decided {self.strategy} ({mine})")

    def _adopt(self, formation: Formation) -> None:
        """Take ``formation`` as this node's ring; a ``ring_formed`` event when its members changed."""
        before = self.members
        structure = allreduce.build(formation.strategy, formation.members, self.sites)
        with self._cond:
            self._structures[formation.epoch] = structure
            self._formations[formation.epoch] = formation
            for old in [e for e in self._formations if e <= formation.epoch - KEEP_FORMATIONS]:
                del self._formations[old]
                self._structures.pop(old, None)
            self.epoch = max(self.epoch, formation.epoch)
            for key in [k for k in self._arrived if k[0] < formation.epoch]:
                del self._arrived[key]
            self._cond.notify_all()
        self.members = list(formation.members)
        if self.members != before:
            self.policies.each("on_membership_change", list(self.members))
        if self.members != before or self.epoch == formation.epoch == 1:
            self.ctx.events.write("ring_formed", round=formation.round, epoch=formation.epoch,
                                  members=formation.members, dropped=[m for m in before if m not in formation.members],
                                  joined=[m for m in formation.members if m not in before])

    def on_abort(self, req: Request) -> Response:
        """A member could not finish formation ``epoch``: stop waiting for its chunks."""
        peer = self.require_sender(req, self.order, "an abort")
        body = req.json()
        epoch = body.get("epoch") if isinstance(body, dict) else None
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise HttpError(400, "bad_abort", "an abort needs the formation's epoch")
        with self._cond:
            formation = self._formations.get(epoch)
            if formation is not None and peer in formation.members:
                self._aborted.add(epoch)
                self._cond.notify_all()
        return ok()

    def _abort(self, formation: Formation, why: str) -> None:
        with self._cond:
            first = formation.epoch not in self._aborted
            self._aborted.add(formation.epoch)
        self.ctx.events.write("ring_aborted", round=formation.round, epoch=formation.epoch, detail=why)
        if first:
            body = json.dumps({"epoch": formation.epoch}).encode()
            parallel(lambda m: self.post(m, "/ring/abort", body, JSON, formation.round, timeout_s=5, retries=0),
                     [m for m in formation.members if m != self.ctx.name])

    # chunks ----------------------------------------------------------------------------------
    def on_chunk(self, req: Request) -> Response:
        sender = self.require_sender(req, self.order, "a chunk")
        peer, arrays, meta = self.receive_weights(req, lambda meta: self.chunk_spec(meta, sender))
        if len(arrays) != 1:
            raise self.reject(req, peer, "a chunk is one array", error="bad_chunk")
        key = (int(meta["epoch"]), str(meta["phase"]), int(meta["step"]))
        with self._cond:
            self._arrived[key] = (peer, arrays[0])
            self._cond.notify_all()
        return ok()

    def _formation(self, epoch: int) -> Formation:
        """Formation ``epoch`` as this node knows it (a chunk may come just before the join's answer)."""
        with self._cond:
            if epoch not in self._formations and epoch <= self.epoch - KEEP_FORMATIONS + 1:
                raise HttpError(409, "unknown_formation", f"formation {epoch} is over for {self.ctx.name}")
            if not self._cond.wait_for(lambda: epoch in self._formations, timeout=self.step_timeout_s):
                raise HttpError(409, "unknown_formation", f"{self.ctx.name} is in no ring formation {epoch}")
            return self._formations[epoch]

    def chunk_spec(self, meta: dict[str, Any], sender: str) -> Optional[list[tuple[tuple[int, ...], str]]]:
        """What a chunk for (epoch, phase, step) must be: from the member before this one in
        that formation, one 1-D array, float64 partial sums in reduce-scatter, the model's
        dtype in all-gather."""
        phase, step, epoch = meta.get("phase"), meta.get("step"), meta.get("epoch")
        if phase not in ("reduce", "gather", "up", "down") or not isinstance(step, int) or not isinstance(epoch, int):
            raise HttpError(400, "bad_chunk", "a chunk needs epoch, phase (reduce, gather, up or down) and step")
        formation = self._formation(epoch)
        n, me = len(formation.members), self.ctx.name
        if phase in ("up", "down"):
            return self.tree_spec(formation, sender, phase, step)
        with self._cond:
            structure = self._structures.get(formation.epoch)
        if structure is None or not structure.is_ring:
            raise HttpError(400, "bad_chunk", f"formation {epoch} of {me} is no ring")
        if me not in formation.members or not 0 <= step < n - 1:
            raise HttpError(400, "bad_chunk", f"no step {step} for {me} in formation {epoch}")
        pos = formation.members.index(me)
        if sender != formation.members[pos - 1]:
            raise HttpError(403, "forbidden", f"only {formation.members[pos - 1]} passes chunks to {me} in "
                                              f"formation {epoch}")
        if self.spec is None:
            return None  # no model to check against (in-memory tests)
        size = len(np.array_split(np.empty(self.elements, dtype=np.uint8), n)[chunk_index(pos, n, phase, step)])
        dtype = "<f8" if phase == "reduce" else np.result_type(*[np.dtype(d) for _, d in self.spec]).str
        return [((size,), dtype)]

    def tree_spec(self, formation: Formation, sender: str, phase: str,
                  step: int) -> Optional[list[tuple[tuple[int, ...], str]]]:
        """What a tree message must be: ``up`` from a child of this node (``step``: the child's
        place in the formation), the whole float64 partial sum; ``down`` from its parent, the mean
        in the model's dtype."""
        with self._cond:
            structure = self._structures.get(formation.epoch)
        me = self.ctx.name
        if structure is None or structure.is_ring or me not in formation.members:
            raise HttpError(400, "bad_chunk", f"formation {formation.epoch} of {me} is no tree")
        if phase == "up":
            if not (0 <= step < len(formation.members) and formation.members[step] == sender
                    and structure.parent_of(sender) == me):
                raise HttpError(403, "forbidden", f"{sender} is not {me}'s child in formation {formation.epoch}")
        elif step != 0 or structure.parent_of(me) != sender:
            raise HttpError(403, "forbidden", f"{sender} is not {me}'s parent in formation {formation.epoch}")
        if self.spec is None:
            return None
        dtype = "<f8" if phase == "up" else np.result_type(*[np.dtype(d) for _, d in self.spec]).str
        return [((self.elements,), dtype)]

    def _take(self, formation: Formation, phase: str, step: int, wait_s: Optional[float] = None) -> np.ndarray:
        key = (formation.epoch, phase, step)
        with self._cond:
            arrived = self._cond.wait_for(lambda: key in self._arrived or formation.epoch in self._aborted
                                          or self.ctx.stop.is_set(), timeout=wait_s or self.step_timeout_s)
            if key in self._arrived:
                return self._arrived.pop(key)[1]
        if arrived and formation.epoch in self._aborted:
            raise RingAborted(f"formation {formation.epoch} was aborted by a member")
        raise RingAborted(f"no {phase} chunk of step {step} in formation {formation.epoch} within "
                          f"{self.step_timeout_s:g}s")

    def _pass(self, formation: Formation, successor: str, phase: str, step: int, chunk: np.ndarray,
              sharing: int = 1) -> None:
        """Send ``chunk`` to ``successor``; ``sharing``: how many such transfers may share a link
        (a tree's root, or a parent with many children, behind one access link)."""
        began = time.perf_counter()
        timeout_s = self.send_timeout_s(successor, chunk.nbytes * sharing + 512)
        if not self.post_weights(successor, "/ring/chunk", formation.round, weights=[chunk],
                                 meta={"phase": phase, "step": step, "epoch": formation.epoch}, retries=0,
                                 timeout_s=timeout_s):
            raise RingAborted(f"could not pass the {phase} chunk of step {step} to {successor}")
        sent = self._sends.setdefault(successor, [0.0, 0.0])
        sent[0] += chunk.nbytes
        sent[1] += time.perf_counter() - began

    def send_bps(self) -> dict[str, float]:
        """The rate of this round's sends to each peer (bits over the seconds its posts took)."""
        return {p: b * 8 / s for p, (b, s) in sorted(self._sends.items()) if s > 0}

    def all_reduce(self, formation: Formation, weights: Weights) -> Weights:
        """The elementwise mean of the ``weights`` of every member of ``formation``, over the
        formation's structure."""
        members = formation.members
        n, i = len(members), members.index(self.ctx.name)
        if n == 1:
            return [w.copy() for w in weights]
        structure = self._structures[formation.epoch]
        if not structure.is_ring:
            return self.tree_reduce(formation, structure, weights)
        successor = members[(i + 1) % n]
        chunks = split(weights, n)
        for step in range(n - 1):  # reduce-scatter: partial sums in float64
            self._pass(formation, successor, "reduce", step, chunks[(i - step) % n])
            chunks[(i - step - 1) % n] += self._take(formation, "reduce", step)
        mine = (i + 1) % n
        chunks[mine] = (chunks[mine] / n).astype(np.result_type(*weights))  # rounded once
        for step in range(n - 1):  # all-gather: finished chunks, in the model's dtype
            self._pass(formation, successor, "gather", step, chunks[(i + 1 - step) % n])
            chunks[(i - step) % n] = self._take(formation, "gather", step)
        return join(chunks, weights)

    def tree_reduce(self, formation: Formation, structure: allreduce.Structure, weights: Weights) -> Weights:
        """The mean over a tree: the children's partial sums added to this node's, sent up; the
        root's mean (rounded once) sent down to every child."""
        me, members = self.ctx.name, formation.members
        total = split(weights, 1)[0]
        for child in structure.children(me):
            total += self._take(formation, "up", members.index(child))
        parent = structure.parent_of(me)
        if parent is None:
            mean = (total / len(members)).astype(np.result_type(*weights))
        else:  # (a parent may take every member's sum through one access link; the mean comes after the whole tree's)
            self._pass(formation, parent, "up", members.index(me), total, sharing=len(members))
            mean = self._take(formation, "down", 0, wait_s=2 * self.step_timeout_s)
        children = structure.children(me)
        failed = [c for c, e in zip(children, parallel(lambda c: self._try_pass(formation, c, mean), children)) if e]
        if failed:
            raise RingAborted(f"could not pass the mean down to {', '.join(failed)}")
        return join([mean], weights)

    def _try_pass(self, formation: Formation, child: str, mean: np.ndarray) -> Optional[str]:
        try:
            self._pass(formation, child, "down", 0, mean, sharing=len(formation.members))
        except RingAborted as e:
            return str(e)
        return None

    # the rounds ------------------------------------------------------------------------------
    def rounds(self) -> Iterator[int]:
        """The round this node wants next, until the ring's last is done; a round whose
        formation aborts is wanted again."""
        while not self.ctx.stop.is_set() and not self.over:
            yield self.want or 0

    def round(self, want: int) -> Optional[RoundRecord]:
        """Train, form the ring (for round ``want``: 0 for a newcomer's first), and all-reduce;
        None when the ring is done, or when this formation aborted (``want`` is formed again)."""
        t_start = time.time()
        start = self.ctx.model.get_weights() if self.ctx.model is not None else []
        trained = self.train_local()
        formation, synced, done = self.form(want or None)
        if done or formation.round > self.sync:
            self.over = True
            return None
        if synced is not None:  # behind: start from the ring's model
            self.ctx.model.set_weights(synced)
        reduced_at = time.perf_counter()
        self._sends = {}
        try:
            self.install(formation, synced is not None or not want)
            local = self.ctx.model.get_weights()
            reduced = self.all_reduce(formation, local)
        except RingAborted as e:
            self.aborts += 1
            self.undo(formation)
            self._abort(formation, str(e))
            if self.aborts > MAX_ABORTS:
                raise RingAborted(f"round {formation.round}: {self.aborts} formations in a row failed ({e})") from None
            self.want = formation.round
            return None
        self.aborts = 0
        self.ctx.model.set_weights(reduced)
        send_s = time.perf_counter() - reduced_at
        if formation.strategy != self.installed:
            self.ctx.events.write("strategy_changed", round=formation.round, strategy=formation.strategy,
                                  previous=self.installed, reason=self.reason, digest=formation.digest)
            self.installed = formation.strategy
        began = time.perf_counter()
        monitors = self.monitors(formation, start if synced is None else None, local, reduced, send_s)
        monitors["monitor_s"] = time.perf_counter() - began  # (their cost, on the round's path)
        loss, accuracy = self.evaluate()
        self.want = formation.round + 1
        self.over = self.want > self.sync
        return RoundRecord(formation.round, t_start, trained, loss, accuracy, send_s, len(formation.members) - 1,
                           {"members": formation.members, "epoch": formation.epoch, **monitors})

    def monitors(self, formation: Formation, start: Optional[Weights], local: Weights, reduced: Weights,
                 collective_s: float) -> dict[str, Any]:
        """The round's monitor fields: strategy, cluster size, goodput (the model's payload over the
        all-reduce's time), the noise scale and (every ``monitor_every`` rounds) the variance of the
        deltas. ``start``: the model the round trained from (None: this node was behind)."""
        n = len(formation.members)
        payload_bytes = sum(int(w.nbytes) for w in local)
        out: dict[str, Any] = {"strategy": formation.strategy, "cluster_size": n,
                               "comm_goodput_bps": payload_bytes * 8 / collective_s if n > 1 and collective_s > 0
                               else None, "gns": None, "grad_var": None}
        if start is None or n < 2 or not start:
            return out
        mine, mean = delta(local, start), delta(reduced, start)
        samples = max(1, self.samples * max(self.epochs, 1))
        out["gns"] = self.noise.update(mine, mean, samples, samples * n)
        if self.monitor_every and formation.round % self.monitor_every == 0:
            out["grad_var"] = grad_var(mine, mean)
        return out

    def adapt(self, event: dict[str, Any]) -> None:
        """This node's policies vote on the round; the votes go with the next join (the members
        decide together when the next formation is made)."""
        if self.policies:  # (as JSON reads them back: the formation must carry them unchanged)
            self.votes_out = json.loads(json.dumps(self.policies.votes({**event, "send_bps": self.send_bps()})))

    def finish(self, completed: bool) -> None:
        """Answer joins held here (and those to come) with "done"."""
        with self._cond:
            self.finished = True
            self._cond.notify_all()
