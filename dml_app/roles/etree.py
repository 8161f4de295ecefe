"""E-tree learning: models aggregated up a multi-layer tree (EdgeTB's el_structure.json).

A node holds one position per layer it appears on (``positions``: layer,
parent, children, ``sync``, ``epoch``). An aggregator position runs ``sync``
rounds: it sends its model to its children in parallel, each child answers with
its own result and sample count, and it combines them by the structure's
``aggregation`` rule (``dml_app.reduction.aggregation``; by default their average weighted
by samples; one ``Aggregator`` per position, so FedAvgM's momentum is a
position's own). A trainer position (layer 1) answers with the model trained ``epoch``
epochs on its shard; an inner position answers with what its own ``sync``
rounds made of the model. Answers are messages of their own (child to parent,
over the child's links), and a child that is the node itself is called directly.
A child is weighted by the samples it reports, at most what its subtree's
dataset confs hold (``child_samples``, which the controller adds).
A user's subclass may override ``aggregate(current, updates, counts)`` (``self.layer``: the
position aggregating). The root runs ``sync`` global rounds, then tells the tree it is done: every
node (``members``), so that the children of an aggregator that died are not left
waiting.

Every aggregating position's round has a deadline (``deadline_s`` of the
position, which dml_tool sets: the structure's ``deadline_s`` at layer 2, and at
a higher layer its children's rounds plus that) and a ``quorum``: the round
closes when every asked child answered, or at the deadline; with fewer answers
than the quorum of the asked it keeps the model it had (``round_failed``), and
with fewer than all it is a ``quorum_round``. A child that missed a round is
dropped (``peer_dropped``) and not asked for a back-off that doubles
(``shared.PeerHealth``; all are asked when all are in one), then asked again and
taken back once it answers (``peer_rejoined``). Each model sent carries an ``ask``
number its answer echoes, so a late answer is never taken for a later round's.

A node's rounds are a recursion down the tree, not ``Role``'s loop of numbered rounds:
``run`` is its own (the root's ``sync`` global rounds, or waiting for the end of the
run), and every position's round is recorded where it closes. A ``round`` event is
numbered by the node's count of rounds; the progress line counts the rounds of the
event's ``layer``. The root's last global round says so down the tree (``last`` in each
model's meta): the last round of every position evaluates on the whole global test set.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

from dml_app.reduction.aggregation import Aggregator
from dml_app.roles.base import NOT_TRAINED, Context, Role, RoundRecord, Weights, ok
from dml_app.roles.shared import PeerHealth, parallel, quorum_count, rule_name
from dml_app.runtime.http import JSON, Request, Response


MAX_SAMPLES = 10**9  # samples a child may claim for its subtree


class ETreeRole(Role):
    name = "etree"
    ROUTES = (("POST", "/etree/model"), ("POST", "/etree/update"), ("POST", "/etree/done"))
    SMALL_ROUTES = frozenset({"/etree/done"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.positions: dict[int, dict[str, Any]] = {int(p["layer"]): p for p in ctx.conf["positions"]}
        self.top = max(self.positions)
        self.is_root = self.positions[self.top]["parent"] is None
        self.deadline_s = float(ctx.conf.get("deadline_s", 60.0))  # a position's round, when it gives none
        self.quorum = float(ctx.conf.get("quorum", 0.5))
        self.health = PeerHealth()
        self.aggregations = {layer: Aggregator(ctx.conf.get("aggregation"))  # by aggregating position
                             for layer in self.positions if layer > 1}
        self.layer = self.top  # the position whose round ``aggregate`` combines
        self._asks = 0
        self.run_timeout_s = float(ctx.conf.get("run_timeout_s", 3600.0))  # a non-root waits for done
        self.root = ctx.conf.get("root")
        self.done = threading.Event()
        self.last: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._waiting: set[tuple[str, int, int]] = set()  # (child, layer, ask) this node waits for
        self._answers: dict[tuple[str, int, int], tuple[Weights, int]] = {}
        self._layer_rounds: dict[int, int] = {}  # rounds recorded per layer
        self._layer_lock = threading.Lock()

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/etree/model"): self.on_model, ("POST", "/etree/update"): self.on_update,
                ("POST", "/etree/done"): self.on_done}

    # messages ---------------------------------------------------------------------------
    def on_model(self, req: Request) -> Response:
        """A parent's model for this node's position on ``layer``: work on it, answer later."""
        parents = {p["parent"] for p in self.positions.values() if p["parent"] is not None}
        self.require_sender(req, parents, "a model")
        peer, arrays, meta = self.receive_weights(req)
        layer = meta.get("layer")
        if layer not in self.positions or self.positions[layer]["parent"] != peer:
            raise self.reject(req, peer, f"{self.ctx.name} has no position on layer {layer!r} under {peer}",
                              error="bad_layer")
        ask = meta.get("ask")
        threading.Thread(target=self._answer, args=(layer, arrays, ask if isinstance(ask, int) else 0,
                                                    meta.get("last") is True), daemon=True).start()
        return ok()

    def _answer(self, layer: int, arrays: Weights, ask: int, last: bool = False) -> None:
        weights, samples = self.work(layer, arrays, last)
        self.post_weights(self.positions[layer]["parent"], "/etree/update", self.round_events, weights=weights,
                          meta={"layer": layer, "samples": samples, "ask": ask})

    def on_update(self, req: Request) -> Response:
        """A child's answer to the model this node sent it."""
        peer, arrays, meta = self.receive_weights(req)
        samples = meta.get("samples", 1)
        if not isinstance(samples, int) or isinstance(samples, bool) or not 0 < samples <= MAX_SAMPLES:
            raise self.reject(req, peer, f"samples must be a whole number in 1..{MAX_SAMPLES}, not {samples!r}")
        layer = meta.get("layer")
        above = self.positions.get(layer + 1) if isinstance(layer, int) else None
        most = (above or {}).get("child_samples", {}).get(peer)
        if isinstance(most, int) and most > 0:  # no more than the child's subtree holds (its dataset confs)
            samples = min(samples, most)
        key = (peer, layer, meta.get("ask"))
        with self._cond:
            expected = key in self._waiting
            if expected:
                self._answers[key] = (arrays, samples)
                self._cond.notify_all()
        if not expected:
            self.ctx.events.write("late_update", peer=peer, layer=meta.get("layer"))
        return ok({"accepted": expected})

    def on_done(self, req: Request) -> Response:
        parents = {p["parent"] for p in self.positions.values() if p["parent"] is not None}
        self.require_sender(req, parents | ({self.root} if self.root else set()), "the end of the run")
        self.done.set()
        return ok()

    # the tree ------------------------------------------------------------------------------
    def work(self, layer: int, weights: Weights, last: bool = False) -> tuple[Weights, int]:
        """This node's answer at ``layer`` to ``weights``: (model, samples behind it). ``last``:
        within the root's last global round, whose last rounds are evaluated on the whole global set."""
        pos = self.positions[layer]
        if layer == 1:
            t_start = time.time()
            self.ctx.model.set_weights(weights)
            trained = self.train_local()
            loss, accuracy = self.evaluate(last=last)
            self._record(t_start, trained, loss, accuracy, 0.0, 0, layer)
            return self.ctx.model.get_weights(), self.samples
        samples, sync = 0, int(pos["sync"])
        for i in range(sync):
            weights, samples = self.aggregate_at(layer, weights, last and i == sync - 1)
        return weights, samples

    def aggregate(self, current: Weights, updates: list[Weights], counts: list[int]) -> Weights:
        """The model of the aggregating position ``self.layer`` from the one its children started
        from (``current``), their ``updates`` and sample ``counts``: the structure's rule."""
        return self.aggregations[self.layer].combine(current, updates, counts)

    def aggregate_at(self, layer: int, weights: Weights, last: bool = False) -> tuple[Weights, int]:
        """One round at an aggregator position: the children asked answer by the deadline,
        combined (``aggregate``) when a quorum did. ``last``: the run's last round at this position."""
        pos, t_start, sent_at = self.positions[layer], time.time(), time.perf_counter()
        deadline_s = float(pos.get("deadline_s", self.deadline_s))
        closes_at = time.monotonic() + deadline_s
        children = list(pos["children"])
        asked = [c for c in children if c == self.ctx.name or c in self.health.usable(children)] or children
        answers = parallel(lambda child: self.ask(child, layer - 1, weights, closes_at, last), asked)
        send_s = time.perf_counter() - sent_at
        got = [a for a in answers if a is not None]
        missing = [c for c, a in zip(asked, answers) if a is None]
        for child, answer in zip(asked, answers):
            if answer is not None and self.health.alive(child):
                self.ctx.events.write("peer_rejoined", layer=layer, peer=child, round=self.round_events + 1)
            elif answer is None and child != self.ctx.name:
                newly, backoff = self.health.failed(child)
                if newly:
                    self.ctx.events.write("peer_dropped", layer=layer, peer=child, round=self.round_events + 1,
                                          retry_in_s=backoff)
        needed = quorum_count(float(pos.get("quorum", self.quorum)), len(asked))
        if len(got) >= needed:
            self.layer = layer
            weights = self.aggregate(weights, [w for w, _ in got], [n for _, n in got])
            closed = "all" if not missing else "quorum"
            if missing:
                self.ctx.events.write("quorum_round", layer=layer, round=self.round_events + 1, missing=missing,
                                      quorum=needed, arrived=len(got))
        else:
            closed = "no_quorum"
            self.ctx.events.write("round_failed", layer=layer, round=self.round_events + 1, missing=missing,
                                  detail=f"{len(got)} of {len(asked)} children answered within {deadline_s:g}s "
                                         f"(quorum {needed})")
        self.ctx.model.set_weights(weights)
        loss, accuracy = self.evaluate(last=last)
        self._record(t_start, NOT_TRAINED, loss, accuracy, send_s, len(got), layer,
                     missing=missing, skipped=[c for c in children if c not in asked], closed=closed,
                     aggregation=rule_name(self, ETreeRole, self.aggregations[layer]))
        return weights, sum(n for _, n in got)

    def ask(self, child: str, layer: int, weights: Weights, closes_at: float,
            last: bool = False) -> Optional[tuple[Weights, int]]:
        """``child``'s answer at ``layer`` (itself: a direct call), or None at ``closes_at``
        (monotonic seconds); ``last``: in the root's last global round."""
        if child == self.ctx.name:
            return self.work(layer, weights, last)
        with self._cond:
            self._asks += 1
            key = (child, layer, self._asks)
            self._waiting.add(key)
        try:
            left = closes_at - time.monotonic()
            body_s = self.send_timeout_s(child, sum(w.nbytes for w in weights))
            if left <= 0 or not self.post_weights(child, "/etree/model", self.round_events, weights=weights,
                                                  meta={"layer": layer, "ask": key[2], "last": last},
                                                  timeout_s=max(0.5, min(left, body_s)), retries=0):
                return None
            with self._cond:
                left = max(0.0, closes_at - time.monotonic())
                if not self._cond.wait_for(lambda: key in self._answers, timeout=left):
                    self.ctx.events.write("child_timeout", peer=child, layer=layer)
                    return None
                return self._answers.pop(key)
        finally:
            with self._cond:
                self._waiting.discard(key)
                self._answers.pop(key, None)

    def _record(self, t_start: float, trained: dict[str, float], loss: float, accuracy: float, send_s: float,
                received: int, layer: int, **extra: Any) -> None:
        self.last = self.record_round(RoundRecord(self.round_events + 1, t_start, trained, loss, accuracy, send_s,
                                                  received, {"layer": layer, **extra}))
        self.adapt(self.last)

    def where(self, record: RoundRecord) -> tuple[Optional[int], int, str]:
        """Progress counts the rounds of the event's layer."""
        layer = record.extra.get("layer")
        if not isinstance(layer, int):
            return super().where(record)
        with self._layer_lock:
            self._layer_rounds[layer] = shown = self._layer_rounds.get(layer, 0) + 1
        return layer, shown, f"layer {layer} round {shown}"

    def tell_done(self) -> None:
        children = {c for p in self.positions.values() for c in p["children"] if c != self.ctx.name}
        if self.is_root:
            children |= set(self.ctx.conf.get("members", []))
        parallel(lambda c: self.post(c, "/etree/done", b"{}", JSON, self.round_events, retries=1),
                 sorted(children))

    def run(self) -> dict[str, Any]:
        """The root's global rounds (each recursing down the tree), or a non-root's wait for the
        end of the run; then tell the tree it is done."""
        self.policies.each("before_run")
        if self.is_root:
            weights, sync = self.ctx.model.get_weights(), int(self.positions[self.top]["sync"])
            for i in range(sync):
                if self.ctx.stop.is_set():
                    break
                weights, _ = self.aggregate_at(self.top, weights, i == sync - 1)
        else:
            deadline = time.monotonic() + self.run_timeout_s
            while not self.done.wait(timeout=1.0):
                if self.ctx.stop.is_set():
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the tree did not finish within {self.run_timeout_s:g}s")
        self.tell_done()
        self.policies.each("after_run")
        return self.result(self.last)
