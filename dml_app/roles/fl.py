"""Federated learning: one aggregator, many trainers (EdgeTB's fl_structure.json).

Each round the aggregator picks ``trainer_fraction`` of the trainers (uniformly,
or by speed: EdgeTB's probability, inversely proportional to a trainer's last
measured train plus send time), sends them the global model in parallel, and
closes the round when every picked trainer has answered, or at ``deadline_s``
if at least a ``quorum`` (a fraction of the picked) did. The new global model
is the updates combined by the structure's ``aggregation`` rule
(``dml_app.reduction.aggregation``; by default FedAvg: averaged, weighted by each trainer's
sample count), which the round event names (``aggregation``).
Updates for a closed round are discarded and logged (``late_update``); a round
without a quorum keeps the old model (``round_failed``). A trainer trains
``epoch`` epochs on each model it gets and sends the result back.

A user algorithm subclasses a role and overrides its hooks: the aggregator's
``aggregate(current, updates, counts)`` (how the updates become the model; by default the
structure's rule), the trainer's ``local_update`` (what it makes of the global model); its own
fields of the round event go into the ``extra`` of the record ``round`` returns.

Trainers die and come back: one that cannot be reached or sends no update by the
deadline is dropped (``peer_dropped``) and, while others are enough to pick from,
skipped for a back-off that doubles (``shared.PeerHealth``); a trainer that starts
(again: a replacement) says so with ``/fl/join``, and the aggregator picks it
from the next round on (``peer_rejoined`` once it contributes). A round closed by
the quorum, not by every update, is a ``quorum_round`` event. A trainer's update may take
as long as the round stays open (the model it gets says how long: ``deadline_s``): the
aggregator's downlink may be shared by every trainer, which a trainer's link does not show.

Elastic scaling: trainers listed in ``standby`` are not picked until a policy's action
(``{"members": [...]}``, ``dml_app.policies.builtin.ElasticScaling``) makes them members; a
``trainers_changed`` event says who came and went, and the first round with the new
members has ``resize_latency_s`` (from the decision to that round's start). Each round
event has ``cluster_size`` (the members) and ``throughput_sps`` (the samples of the
round's updates over the round's seconds).

The aggregator takes an update only from a trainer it asked in the open round
(the sender proven by the message's signature), weighted by the sample count the
trainer's dataset conf gives (``trainer_samples`` in the structure conf; the
count a message claims is ignored). A trainer takes models only from its aggregator.
"""
from __future__ import annotations

import math
import queue
import random
import threading
import time
from typing import Any, Callable, Iterator, Optional

from dml_app.reduction.aggregation import Aggregator
from dml_app.roles.base import NOT_TRAINED, Context, Role, RoundRecord, Weights, ok
from dml_app.roles.shared import PeerHealth, parallel, quorum_count, rule_name
from dml_app.runtime.http import JSON, HttpError, Request, Response
from dml_app.wire import weights as wire

MAX_UPLOAD_S = 86_400.0  # the longest upload time a model's deadline_s may ask for


def pick(rng: random.Random, trainers: list[str], k: int, seconds: Optional[dict[str, float]] = None) -> list[str]:
    """``k`` distinct trainers: uniformly, or with ``seconds`` (measured round-trip work per
    trainer) each draw favours the fast, with probability proportional to 1 / seconds."""
    if not seconds:
        return rng.sample(trainers, k)
    known = [s for s in seconds.values() if s > 0]
    default = min(known) if known else 1.0  # the unmeasured are tried early
    pool, picked = list(trainers), []
    for _ in range(k):
        weights = [1.0 / max(seconds.get(t, default), 1e-3) for t in pool]
        chosen = rng.choices(range(len(pool)), weights=weights)[0]
        picked.append(pool.pop(chosen))
    return picked


def _seconds(value: Any) -> float:
    """A duration a trainer reports (for speed selection), bounded; junk counts as 0."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return 0.0
    return min(max(seconds, 0.0), 86400.0) if math.isfinite(seconds) else 0.0


def candidates(trainers: list[str], usable: list[str], k: int) -> list[str]:
    """Whom a round picks ``k`` from: the trainers not in a back-off, when they are enough."""
    return usable if len(usable) >= k else trainers


class AggregatorRole(Role):
    name = "fl_aggregator"
    ROUTES = (("POST", "/fl/update"), ("POST", "/fl/join"))
    SMALL_ROUTES = frozenset({"/fl/join"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        conf = ctx.conf
        self.trainers: list[str] = list(conf["trainers"])
        self.fraction = float(conf.get("trainer_fraction", 1.0))
        self.selection = str(conf.get("selection", "uniform"))
        self.deadline_s = float(conf.get("deadline_s", 60.0))
        self.quorum = float(conf.get("quorum", 0.5))
        standby = [str(t) for t in conf.get("standby") or [] if t in self.trainers]
        self.members = [t for t in self.trainers if t not in standby] or standby[:1]  # those picked from
        self.view.members, self.view.standby = list(self.members), standby
        self.k = max(1, round(self.fraction * len(self.members)))  # trainers picked per round
        self._resized_at: Optional[float] = None  # when a policy last changed the members
        self.rng = random.Random(f"{ctx.name}-{ctx.conf.get('model', {}).get('seed', 0)}")
        self.seconds: dict[str, float] = {}  # trainer -> last train_s + send_s
        self._lock = threading.Lock()
        self._round = 0
        self._open = False
        self._expected: set[str] = set()
        self._updates: dict[str, tuple[Weights, int]] = {}
        self._complete = threading.Event()
        self.health = PeerHealth()
        self.aggregation = Aggregator(conf.get("aggregation"))  # the rule, and its state between rounds
        given = conf.get("trainer_samples") or {}
        self.trainer_samples: dict[str, int] = {t: int(given.get(t, 1)) for t in self.trainers}
        bad = [t for t, n in self.trainer_samples.items() if n <= 0]
        if bad:
            raise ValueError(f"trainer_samples must be positive, not for {', '.join(bad)}")

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/fl/update"): self.on_update, ("POST", "/fl/join"): self.on_join}

    def on_join(self, req: Request) -> Response:
        """A trainer (re)started: pick it again from the next round."""
        peer = self.require_sender(req, self.trainers, "a join")
        if self.health.alive(peer):
            self.ctx.events.write("peer_rejoined", round=self._round, peer=peer, how="joined")
        return ok({"round": self._round})

    def on_update(self, req: Request) -> Response:
        self.require_sender(req, self.trainers, "an update")
        peer, arrays, meta = self.receive_weights(req)
        with self._lock:
            on_time = (self._open and meta.get("round") == self._round and peer in self._expected
                       and peer not in self._updates)
            if on_time:
                self._updates[peer] = (arrays, self.trainer_samples[peer])
                self.seconds[peer] = _seconds(meta.get("train_s")) + _seconds(meta.get("send_s"))
                if self._expected <= set(self._updates):
                    self._complete.set()
        if not on_time:
            self.ctx.events.write("late_update", round=meta.get("round"), peer=peer, current_round=self._round)
        return ok({"accepted": on_time})

    def round(self, r: int) -> RoundRecord:
        """Send the global model to the picked trainers, wait for their updates until all came
        or the deadline, and combine them (``aggregation``) when a quorum did."""
        t_start, closes_at = time.time(), time.monotonic() + self.deadline_s
        resized = {} if self._resized_at is None else {"resize_latency_s": t_start - self._resized_at}
        self._resized_at = None
        pool = candidates(self.members, self.health.usable(self.members), self.k)
        picked = pick(self.rng, pool, self.k, self.seconds if self.selection == "speed" else None)
        with self._lock:
            self._round, self._open, self._expected, self._updates = r, True, set(picked), {}
            self._complete.clear()
        body = wire.encode(self.ctx.model.get_weights(), {"from": self.ctx.name, "round": r,
                                                          "deadline_s": self.deadline_s}, self.weight_names)
        sent_at = time.perf_counter()
        answers = parallel(lambda t: self.post(t, "/fl/train", body, wire.CONTENT_TYPE, r,
                                               timeout_s=self.deadline_s, retries=0), picked)
        send_s = time.perf_counter() - sent_at
        unreachable = {t for t, a in zip(picked, answers) if a is None}
        with self._lock:  # no need to wait for trainers that never got the model
            self._expected -= unreachable
            if self._expected <= set(self._updates):
                self._complete.set()
        self._complete.wait(timeout=max(0.0, closes_at - time.monotonic()))
        with self._lock:
            self._open = False
            updates = dict(self._updates)
        missing = sorted(set(picked) - set(updates))
        self._membership(r, sorted(updates), missing, unreachable)
        closed_at = time.perf_counter()
        if len(updates) >= quorum_count(self.quorum, len(picked)):
            self.ctx.model.set_weights(self.aggregate(self.ctx.model.get_weights(),
                                                      [w for w, _ in updates.values()],
                                                      [n for _, n in updates.values()]))
            closed = "all" if not missing else "quorum"
            if missing:
                self.ctx.events.write("quorum_round", round=r, arrived=sorted(updates), missing=missing,
                                      quorum=quorum_count(self.quorum, len(picked)))
        else:
            closed = "no_quorum"
            self.ctx.events.write("round_failed", round=r, picked=picked, arrived=sorted(updates),
                                  detail=f"{len(updates)} of {len(picked)} updates by the deadline")
        throughput_sps = sum(n for _, n in updates.values()) / max(time.time() - t_start, 1e-6)
        loss, accuracy = self.evaluate(r)
        return RoundRecord(r, t_start, NOT_TRAINED, loss, accuracy, send_s, len(updates),
                           {"picked": picked, "missing": missing, "closed": closed,
                            "samples": {t: n for t, (_, n) in updates.items()},
                            "aggregate_s": time.perf_counter() - closed_at, "aggregation": rule_name(self, AggregatorRole, self.aggregation),
                            "cluster_size": len(self.members), "throughput_sps": throughput_sps, **resized})

    def aggregate(self, current: Weights, updates: list[Weights], counts: list[int]) -> Weights:
        """The next global model from the one the trainers started from (``current``), their
        ``updates`` and their sample ``counts``: the structure's ``aggregation`` rule."""
        return self.aggregation.combine(current, updates, counts)

    def apply(self, action: dict[str, Any]) -> None:
        """A policy's action: the batch size, or the trainers picked from (``members``)."""
        super().apply(action)
        if "members" not in action:
            return
        members = [t for t in self.trainers if t in action["members"]]  # (in the structure's order)
        unknown = sorted(set(action["members"]) - set(self.trainers))
        if unknown or not members:
            raise ValueError(f"a policy's members must be some of the trainers ({', '.join(self.trainers)}), "
                             f"not {action['members']!r}")
        added, removed = [t for t in members if t not in self.members], [t for t in self.members if t not in members]
        self.members, self.view.members = members, list(members)
        self.k = max(1, round(self.fraction * len(members)))
        self.policies.each("on_membership_change", list(members))
        self._resized_at = time.time()
        self.ctx.events.write("trainers_changed", round=self._round + 1, added=added, removed=removed,
                              members=members, reason=str(action.get("reason", "")))  # (the round it applies to)

    def finish(self, completed: bool) -> None:
        """Once every round ran, tell every trainer the run is over."""
        super().finish(completed)
        if completed:
            parallel(lambda t: self.post(t, "/fl/done", b"{}", JSON, self.sync, timeout_s=10, retries=0),
                     self.trainers)

    def _membership(self, round_no: int, arrived: list[str], missing: list[str], unreachable: set[str]) -> None:
        """Drop the trainers that missed the round, take back those that contributed again."""
        for t in arrived:
            if self.health.alive(t):
                self.ctx.events.write("peer_rejoined", round=round_no, peer=t, how="sent an update")
        for t in missing:
            newly, backoff = self.health.failed(t)
            if newly:
                self.ctx.events.write("peer_dropped", round=round_no, peer=t, retry_in_s=backoff,
                                      why="unreachable" if t in unreachable else "no update by the deadline")


class TrainerRole(Role):
    name = "fl_trainer"
    ROUTES = (("POST", "/fl/train"), ("POST", "/fl/done"))
    SMALL_ROUTES = frozenset({"/fl/done"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.aggregator = str(ctx.conf["aggregator"])
        self.idle_timeout_s = float(ctx.conf.get("idle_timeout_s", 600.0))
        self.inbox: "queue.Queue[Optional[tuple[Weights, dict[str, Any]]]]" = queue.Queue()
        self.last_send_s = 0.0
        self.job: Optional[tuple[Weights, dict[str, Any]]] = None  # the model of the round being run, its meta

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/fl/train"): self.on_train, ("POST", "/fl/done"): self.on_done}

    def on_train(self, req: Request) -> Response:
        self.require_sender(req, [self.aggregator], "a model to train")
        _, arrays, meta = self.receive_weights(req)
        if not isinstance(meta.get("round"), int):
            raise HttpError(400, "bad_weights", "a model to train needs its round number")
        self.inbox.put((arrays, meta))
        return ok()

    def on_done(self, req: Request) -> Response:
        self.require_sender(req, [self.aggregator], "the end of the run")
        self.inbox.put(None)
        return ok()

    def rounds(self) -> Iterator[int]:
        """Say this trainer is (again) ready, then a round for each model the aggregator
        sends (``job``), until it says the run is over."""
        self.post(self.aggregator, "/fl/join", b"{}", JSON, 0, timeout_s=10, retries=2)
        while not self.ctx.stop.is_set():
            try:
                job = self.inbox.get(timeout=self.idle_timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no word from the aggregator {self.aggregator} "
                                   f"for {self.idle_timeout_s:g}s") from None
            if job is None:
                return
            self.job = job
            yield int(job[1]["round"])

    def round(self, r: int) -> RoundRecord:
        """Make the update of ``job``'s model (``local_update``) and send it back."""
        assert self.job is not None
        arrays, meta = self.job
        t_start = time.time()
        upload_s = upload_timeout_s(meta)
        trained = self.local_update(arrays, meta)
        loss, accuracy = self.evaluate(r)
        sent_at = time.perf_counter()
        self.post_weights(self.aggregator, "/fl/update", r,
                          meta={"train_s": trained["train_s"], "send_s": self.last_send_s}, timeout_s=upload_s)
        self.last_send_s = time.perf_counter() - sent_at
        return RoundRecord(r, t_start, trained, loss, accuracy, self.last_send_s, 1)

    def local_update(self, arrays: Weights, meta: dict[str, Any]) -> dict[str, float]:
        """Leave the model holding this trainer's update of the global model ``arrays`` (the
        round's ``meta`` as the aggregator sent it); ``train_local``'s kind of answer. By default:
        ``epoch`` epochs from the global model."""
        self.ctx.model.set_weights(arrays)
        return self.train_local()


def upload_timeout_s(meta: dict[str, Any]) -> Optional[float]:
    """How long an update may take to reach the aggregator: the round's ``deadline_s`` the
    aggregator sent with the model (None without one: the link's rate and a margin)."""
    value = meta.get("deadline_s")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_UPLOAD_S:
        return None
    return float(value)
