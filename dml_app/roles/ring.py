"""Ring all-reduce with elastic membership: every node trains, then the ring averages
the models of that round's members exactly.

The weights are flattened into one vector and cut with ``np.array_split`` into
one chunk per member (a layer smaller than the ring is no special case: every
element is in some chunk; ``dml_app.reduction.allreduce``). Reduce-scatter: in n - 1 steps each
member passes a partial sum on to its successor and adds what its predecessor passed it, so
each ends up owning the full sum of one chunk, which it divides by n.
All-gather: n - 1 more steps pass the finished chunks around. Partial sums
travel as float64 and finished chunks in the model's dtype, so the result is
the elementwise mean of the members' models, rounded once.

Membership (``dml_app.roles.ring_membership``, a ``RingMembership`` the role holds): before
each all-reduce the ring is *formed* by the live nodes, at round boundaries only; a node that
died is left out of the next ring and its replacement taken in. A step that fails (a member
died mid-round) aborts the formation, and the round is formed and run again without the lost
member.

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
import time
from typing import Any, Callable, Iterator, Optional

import numpy as np

from dml_app.policies.monitors import NoiseScale, delta, grad_var
from dml_app.reduction import allreduce
from dml_app.reduction.allreduce import chunk_index, join, split
from dml_app.roles.base import Context, Role, RoundRecord, Weights, ok
from dml_app.roles.ring_membership import (BadJoin, Formation, RingAborted, RingMembership, UnknownFormation,
                                           answer_body)
from dml_app.roles.shared import parallel
from dml_app.runtime.http import HttpError, Request, Response
from dml_app.wire import weights as wire

MAX_ABORTS = 5  # formations of one round that may fail in a row before the node gives up


class StrategyRefused(RingAborted):
    """This node decided another structure than the formation's (a different digest)."""


class RingRole(Role):
    name = "ring"
    ROUTES = (("POST", "/ring/chunk"), ("POST", "/ring/join"), ("POST", "/ring/abort"))
    SMALL_ROUTES = frozenset({"/ring/abort"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.order: list[str] = list(ctx.conf["ring"])
        life = int(ctx.conf.get("life", 1))
        self.elements = 0 if self.spec is None else sum(int(np.prod(s)) for s, _ in self.spec)
        self.step_timeout_s = float(ctx.conf.get("step_timeout_s", 120.0))
        self.want: Optional[int] = None if life > 1 else 1  # the round to form next (None: a newcomer's)
        self.over = False  # the ring ran its last round (or is done)
        self.aborts = 0  # formations of round ``want`` that failed in a row
        self.strategy = str(ctx.conf.get("strategy") or allreduce.DEFAULT)  # the one decided for the next formation
        allreduce.parse(self.strategy, self.order)
        self.sites: dict[str, str] = {str(k): str(v) for k, v in (ctx.conf.get("sites") or {}).items()}
        self.membership = RingMembership(
            ctx.name, self.order, self.post, ctx.events, ctx.stop, sync=self.sync, life=life,
            step_timeout_s=self.step_timeout_s, join_wait_s=float(ctx.conf.get("join_wait_s", 30.0)),
            sites=self.sites, spec=self.spec, settle=self._settle,
            on_change=lambda members: self.policies.each("on_membership_change", members))
        self._cond = self.membership.cond  # chunks wait on it too: an abort wakes them
        self._arrived: dict[tuple[int, str, int], tuple[str, np.ndarray]] = {}
        self.installed = self.strategy  # the strategy of the last formation this node ran
        self.reason = "the structure file's"  # why ``strategy`` is what it is
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

    # membership (``membership``: the formations) -------------------------------------------------
    def on_join(self, req: Request) -> Response:
        """A node's join: held until this node forms the ring (then the formation, with the
        model for one behind), or learns another coordinates (``redirect``)."""
        peer = self.require_sender(req, self.order, "a join")
        try:
            meta = self.membership.hold(peer, req.json())
        except BadJoin as e:
            raise HttpError(400, "bad_join", str(e)) from None
        # through the compute thread: never a copy taken half-way through a training step
        weights = self.ctx.compute(self.ctx.model.get_weights) if meta.get("behind") and self.ctx.model is not None \
            else []
        body = answer_body(self.ctx.name, meta, weights, self.weight_names)
        if weights:  # a model for a node behind (a formation alone is a small reply on its connection)
            self.count_sent_answer(req, body)
        return 200, wire.CONTENT_TYPE, body

    def on_abort(self, req: Request) -> Response:
        """A member could not finish formation ``epoch``: stop waiting for its chunks."""
        peer = self.require_sender(req, self.order, "an abort")
        body = req.json()
        epoch = body.get("epoch") if isinstance(body, dict) else None
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            raise HttpError(400, "bad_abort", "an abort needs the formation's epoch")
        self.membership.aborted_by(peer, epoch)
        return ok()

    def _settle(self, formation: Formation) -> None:
        """What a formation this node coordinates carries: its round's decisions on the members'
        votes, the strategy and batch size they make, and the structure's digest."""
        self._decide(formation)
        formation.strategy, formation.batch_size = self.strategy, self.batch_size
        formation.digest = allreduce.build(self.strategy, formation.members, self.sites).digest()

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
        structure = formation.structure  # (built from the formation's strategy when it was adopted)
        if structure is None or self.strategy != formation.strategy or structure.digest() != formation.digest:
            mine = allreduce.build(self.strategy, formation.members, self.sites).digest()
            self.ctx.events.write("strategy_refused", round=formation.round, epoch=formation.epoch,
                                  strategy=self.strategy, formation_strategy=formation.strategy,
                                  digest=mine, formation_digest=formation.digest)
            raise StrategyRefused(f"formation {formation.epoch} uses {formation.strategy} "
                                  f"({formation.digest}); this node decided {self.strategy} ({mine})")

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

    def chunk_spec(self, meta: dict[str, Any], sender: str) -> Optional[list[tuple[tuple[int, ...], str]]]:
        """What a chunk for (epoch, phase, step) must be: from the member before this one in
        that formation, one 1-D array, float64 partial sums in reduce-scatter, the model's
        dtype in all-gather."""
        phase, step, epoch = meta.get("phase"), meta.get("step"), meta.get("epoch")
        if phase not in ("reduce", "gather", "up", "down") or not isinstance(step, int) or not isinstance(epoch, int):
            raise HttpError(400, "bad_chunk", "a chunk needs epoch, phase (reduce, gather, up or down) and step")
        try:
            formation = self.membership.formation(epoch)
        except UnknownFormation as e:
            raise HttpError(409, "unknown_formation", str(e)) from None
        n, me = len(formation.members), self.ctx.name
        if phase in ("up", "down"):
            return self.tree_spec(formation, sender, phase, step)
        structure = formation.structure
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
        structure, me = formation.structure, self.ctx.name
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
            arrived = self._cond.wait_for(lambda: key in self._arrived or self.membership.is_aborted(formation.epoch)
                                          or self.ctx.stop.is_set(), timeout=wait_s or self.step_timeout_s)
            if key in self._arrived:
                return self._arrived.pop(key)[1]
        if arrived and self.membership.is_aborted(formation.epoch):
            raise RingAborted(f"formation {formation.epoch} was aborted by a member")
        raise RingAborted(f"no {phase} chunk of step {step} in formation {formation.epoch} within "
                          f"{self.step_timeout_s:g}s")

    def _forget_chunks_before(self, epoch: int) -> None:
        with self._cond:
            for key in [k for k in self._arrived if k[0] < epoch]:
                del self._arrived[key]

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
        structure = formation.structure
        if structure is None:
            raise RingAborted(f"formation {formation.epoch} has no structure: it was never adopted")
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
        formation, synced, done = self.membership.form(want or None)
        if not done:
            self._forget_chunks_before(formation.epoch)
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
            self.membership.abort(formation, str(e))
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
        loss, accuracy = self.evaluate(formation.round)
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
            votes = self.policies.votes({**event, "send_bps": self.send_bps()})
            self.membership.votes_out = json.loads(json.dumps(votes))

    def finish(self, completed: bool) -> None:
        """Answer joins held here (and those to come) with "done"."""
        super().finish(completed)
        self.membership.finish()
