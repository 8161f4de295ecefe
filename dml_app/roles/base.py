"""What every role shares: the round loop, sending through next hops, traffic, events.

``Role.run`` owns the loop: ``round(r)`` for each ``r`` that ``rounds()`` yields, each
``RoundRecord`` it returns written as a ``round`` event (``record_round``), then
``finish()``. A role says what a round is by overriding these hooks (an E-tree node,
whose rounds are a recursion down the tree, overrides ``run``). Failures are data: a
send that fails is an event, and the role decides what to do next.

Messages go to a destination's next hop: the peer itself when the two are
linked (``connect``), else the hop that ``forward`` names, whose ``/relay``
passes the body on. Bytes are counted against the next hop, so traffic per peer
follows the links. A ``Transport`` delivers them (``dml_app.runtime.transport``: signed
HTTP in a node; ``dml_app.roles.memory``: calls between roles of one process, in tests).

Every message is signed end to end with the pair key of its sender and its
destination (a relay passes that signature on untouched, so it can neither
forge nor alter a message), and per hop with the pair key of the two linked
nodes; a role takes the sender from ``Request.sender``, never from the message.
Weights are checked against the model (layer count, shapes, dtypes, finite
values) before anything is queued: a bad one is answered 400 and logged as a
``rejected_update`` event.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional

import numpy as np

from dml_app.models.contract import weight_names_of
from dml_app.policies.contract import PolicyView
from dml_app.policies.monitors import MONITOR_FIELDS
from dml_app.policies.runner import Policies, build as build_policies
from dml_app.roles.global_eval import EvalPlan, GlobalSample
from dml_app.roles.phases import Phases
from dml_app.runtime.auth import E2E, AuthFailed, NodeKeys
from dml_app.runtime.compute import inline
from dml_app.runtime.events import EventLog
from dml_app.runtime.http import HttpError, Request, Response, json_response
from dml_app.runtime.transport import MAX_RELAYS, TTL_HEADER, HttpTransport, Transport
from dml_app.wire import weights as wire

Weights = list[np.ndarray]
SEND_MARGIN = 4.0  # a send may take this many times its time at the link's rate ...
SEND_BASE_S = 5.0  # ... plus this, before it is given up (a dead, paused or cut-off peer)
DEFAULT_SEND_TIMEOUT_S = 60.0  # when the link's rate is not known
RELAY_WAIT_S = 600.0  # a relay waits this long for the answer it passes back (a ring join is held)


@dataclass
class Context:
    """What a role gets from the node runtime."""

    name: str
    model: Any
    data: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # x_train, y_train, x_test, y_test
    conf: dict[str, Any]  # the node's structure conf
    dataset_conf: dict[str, Any]
    events: EventLog
    progress: Callable[..., None]  # progress(message, round=..., accuracy=...)
    port: int = 4444
    global_test: Optional[tuple[np.ndarray, np.ndarray]] = None  # the run's common test set (x, y), if any
    stop: threading.Event = field(default_factory=threading.Event)
    auth: Optional[NodeKeys] = None  # signs this node's messages to peers
    compute: Callable[..., Any] = inline  # runs model calls: compute(fn, *args) (a node: off its event loop)
    transport: Optional[Transport] = None  # delivers messages to peers (None: signed HTTP, with auth)
    workdir: str = "."  # the experiment directory (a user's policy file is found there)


@dataclass
class RoundRecord:
    """What a round did, for its ``round`` event: ``trained`` is ``train_local``'s answer,
    ``received`` the models that went into it, ``extra`` the role's own fields."""

    round: int
    t_start: float  # time.time() when the round began
    trained: dict[str, float]
    loss: float
    accuracy: float
    send_s: float
    received: int
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Traffic:
    """Bytes sent and received per peer (next hop), taken once per round event."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recv: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        sent, recv = dict(self.sent), dict(self.recv)
        self.sent.clear()
        self.recv.clear()
        return sent, recv


NOT_TRAINED = {"loss": float("nan"), "train_s": 0.0}  # ``trained`` of a round without local training


class Role:
    """Base of every algorithm's role; subclasses override the hooks (or ``run``)."""

    name = "role"
    ROUTES: tuple[tuple[str, str], ...] = ()  # (method, path) of the role's own endpoints
    SMALL_ROUTES: frozenset[str] = frozenset()  # those of ROUTES that carry no weights (a small body)

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.traffic = Traffic()
        self.sync = int(ctx.conf.get("sync", 1))  # rounds to run
        self.epochs = int(ctx.conf.get("epoch", 1))
        self.batch_size = int(ctx.dataset_conf.get("batch_size", 32))
        self.connect: dict[str, str] = dict(ctx.conf.get("connect", {}))  # linked peer -> "ip:port"
        self.link_bps: dict[str, int] = {str(p): int(r) for p, r in (ctx.conf.get("link_bps") or {}).items()
                                         if isinstance(r, (int, float)) and r > 0}  # linked peer -> rate
        self.next_hop: dict[str, str] = dict(ctx.conf.get("forward", {}))  # destination -> linked peer
        self.samples = int(len(ctx.data[1]))
        self.round_events = 0
        self.finished = False  # rounds done (or failed): handlers answer, and drop what comes
        self.transport: Transport = ctx.transport if ctx.transport is not None else HttpTransport(self.connect,
                                                                                                 ctx.auth,
                                                                                                 self.body_limit)
        self._traffic_lock = threading.Lock()
        self.phases = Phases()  # train, evaluate and send intervals: each round event's ``phases``
        self._global_eval: dict[int, tuple[Any, Any, int]] = {}  # by thread: E-tree evaluates in several
        self.eval_plan = EvalPlan.of(ctx.conf)  # when, and on how many samples, the global test set
        self._global_sample = GlobalSample()
        # what a model message must look like (none without a model: in-memory tests)
        self.spec: Optional[wire.Spec] = None if ctx.model is None else wire.spec_of(ctx.model.get_weights())
        self._limit_of: tuple[Optional[wire.Spec], int] = (None, 0)  # (spec, body_limit(spec))
        self.weight_names = weight_names_of(ctx.model)  # the arrays' names on the wire (by layer), if any
        self.view = PolicyView(ctx.name, self.name, [ctx.name], ctx.conf.get("strategy"), self.batch_size,
                               dict(self.link_bps), dict(ctx.conf.get("sites") or {}))
        self.policies = Policies(build_policies(ctx.conf.get("policies") or [], self.view, ctx.workdir),
                                 ctx.events, self.apply)

    # hooks -------------------------------------------------------------------------
    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        """Handlers of ``ROUTES``."""
        return {}

    def early_answer(self, key: tuple[str, str], req: Request) -> Optional[Response]:
        """An answer to a call of ``ROUTES`` from its (authenticated) headers alone, before its
        body crosses the link (None: read the body, call the handler)."""
        return None

    def rounds(self) -> Iterator[int]:
        """The numbers of the rounds to run: 1 to ``sync``, until the node is stopped."""
        for r in range(1, self.sync + 1):
            if self.ctx.stop.is_set():
                return
            yield r

    def round(self, round_no: int) -> Optional[RoundRecord]:
        """Run round ``round_no``; None when it is not one to record (it is run again)."""
        raise NotImplementedError(f"{type(self).__name__} does not say what a round is")

    def finish(self, completed: bool) -> None:
        """After the rounds: ``completed`` when they all ran, False when one raised (the error
        goes on). By default, stop taking messages (``finished``)."""
        self.finished = True

    def apply(self, action: dict[str, Any]) -> None:
        """Take a policy's action: a new batch size (the next round's training uses it)."""
        if "batch_size" in action:
            self.batch_size = self.view.batch_size = int(action["batch_size"])

    def adapt(self, event: dict[str, Any]) -> None:
        """After a recorded round: the policies vote on its ``event`` and this node decides
        alone (a ring overrides this: its members decide together at the next formation)."""
        if self.policies:
            self.policies.decide(int(event["round"]) + 1, {self.ctx.name: self.policies.votes(event)})

    def where(self, record: RoundRecord) -> tuple[Optional[int], int, str]:
        """(layer, round shown, words) of a round's progress line."""
        return None, record.round, f"round {record.round}/{self.sync}"

    # the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        """The rounds, each recorded; the ``done`` event's fields (``result``)."""
        last: dict[str, Any] = {}
        completed = False
        self.policies.each("before_run")
        try:
            for r in self.rounds():
                self.policies.each("before_round", r)
                record = self.round(r)
                if record is not None:
                    last = self.record_round(record)
                    self.adapt(last)
            completed = True
        finally:
            self.finish(completed)
        self.policies.each("after_run")
        return self.result(last)

    # helpers for subclasses -------------------------------------------------------------
    def train_local(self) -> dict[str, float]:
        """``epoch`` epochs on the local shard (none when ``epoch`` is 0)."""
        if self.epochs <= 0:
            return NOT_TRAINED
        x_train, y_train = self.ctx.data[0], self.ctx.data[1]
        with self.phases.timed("train"):
            return self.ctx.compute(self.ctx.model.train, x_train, y_train, self.epochs, self.batch_size)

    def evaluate(self, round_no: Optional[int] = None, last: Optional[bool] = None) -> tuple[float, float]:
        """(loss, accuracy) on the local test shard. With a global test set, the model is evaluated
        on it too as ``eval_plan`` says for round ``round_no`` (default: the round this node records
        next), on the whole set when ``last`` (default: ``round_no`` is ``sync`` or later); this
        thread's next ``record_round`` reports that."""
        with self.phases.timed("evaluate"):
            return self._evaluate(round_no, last)

    def _evaluate(self, round_no: Optional[int], last: Optional[bool]) -> tuple[float, float]:
        compute, model = self.ctx.compute, self.ctx.model
        loss, accuracy = compute(model.evaluate, self.ctx.data[2], self.ctx.data[3])
        global_test = self.ctx.global_test
        if global_test is not None:
            round_no = self.round_events + 1 if round_no is None else round_no
            n = self.eval_plan.size(round_no, round_no >= self.sync if last is None else last, len(global_test[1]))
            result = (compute(model.evaluate, *self._global_sample.take(global_test, n, self.eval_plan.seed))
                      if n else (None, None))
            self._global_eval[threading.get_ident()] = (*result, n)
        return loss, accuracy

    def record_round(self, record: RoundRecord) -> dict[str, Any]:
        """Write a ``round`` event (with this round's traffic and, when the node has a global
        test set, this thread's last ``evaluate`` on it: ``global_eval_n`` samples, 0 when the
        round was not evaluated) and report progress (``where``)."""
        with self._traffic_lock:
            sent_to, recv_from = self.traffic.take()
        global_loss, global_accuracy, global_n = self._global_eval.pop(threading.get_ident(), (None, None, None))
        self.round_events += 1
        trained, loss, accuracy = record.trained, record.loss, record.accuracy
        t_end = time.time()
        event = self.ctx.events.write(
            "round", round=record.round, t_start=record.t_start, t_end=t_end, loss=loss, accuracy=accuracy,
            global_loss=global_loss, global_accuracy=global_accuracy, global_eval_n=global_n,
            train_loss=None if trained["loss"] != trained["loss"] else trained["loss"], train_s=trained["train_s"],
            send_s=record.send_s, bytes_sent=sum(sent_to.values()), bytes_recv=sum(recv_from.values()),
            sent_to=sent_to, recv_from=recv_from, received_models=record.received, batch_size=self.batch_size,
            phases=self.phases.take(record.t_start, t_end), **record.extra)
        layer, shown, where = self.where(record)
        if global_accuracy is None:
            message = f"{where}: accuracy {accuracy:.3f} loss {loss:.3f}"
        else:
            message = f"{where}: global accuracy {global_accuracy:.3f} loss {global_loss:.3f} (local {accuracy:.3f})"
        monitors = {k: event[k] for k in MONITOR_FIELDS if event.get(k) is not None}
        if self.policies.recent:  # the decisions since the last report: the live timeline shows them
            monitors["decisions"] = self.policies.take_recent()
        self.ctx.progress(message, round=shown, layer=layer, accuracy=accuracy, global_accuracy=global_accuracy,
                          loss=loss, global_loss=global_loss, global_eval_n=global_n, bytes_sent=event["bytes_sent"],
                          **monitors)
        return event

    def result(self, last: dict[str, Any]) -> dict[str, Any]:
        """The ``done`` event's fields: the last round's figures, and the traffic that
        came after it (an answer sent once the last round was recorded)."""
        with self._traffic_lock:
            sent_to, recv_from = self.traffic.take()
        return {"rounds": last.get("round", 0), "accuracy": last.get("accuracy"), "loss": last.get("loss"),
                "bytes_sent": sum(sent_to.values()), "bytes_recv": sum(recv_from.values()),
                "sent_to": sent_to, "recv_from": recv_from}

    def hop_to(self, dest: str) -> str:
        """The linked node a message to ``dest`` goes to: ``dest``, or the one ``forward`` names."""
        hop = self.next_hop.get(dest, dest)
        if hop not in self.connect:
            raise ConnectionError(f"no route from {self.ctx.name} to {dest}")
        return hop

    def body_limit(self) -> int:
        """The largest body a weights route of this role takes (worked out once per ``spec``: every
        call in and out asks)."""
        spec = self.spec
        if spec is None:
            return wire.MAX_HEADER_BYTES
        if self._limit_of[0] is not spec:
            self._limit_of = (spec, wire.body_limit(spec))
        return self._limit_of[1]

    def send_timeout_s(self, dest: str, size_bytes: int) -> float:
        """How long a send of ``size_bytes`` to ``dest`` may take: ``SEND_MARGIN`` times its time
        at the rate of the link to the next hop, plus ``SEND_BASE_S`` (60 s when the rate is unknown)."""
        rate = self.link_bps.get(self.next_hop.get(dest, dest))
        if not rate:
            return DEFAULT_SEND_TIMEOUT_S
        return SEND_BASE_S + SEND_MARGIN * size_bytes * 8.0 / rate

    def post(self, dest: str, path: str, body: bytes, content_type: str, round_no: int,
             timeout_s: Optional[float] = None, retries: int = 1, ttl: int = MAX_RELAYS,
             signed: Optional[dict[str, str]] = None,
             answer_headers: Optional[dict[str, str]] = None) -> Optional[bytes]:
        """POST ``body`` to ``dest`` through ``transport``; returns the answer, or None after a
        ``send_failed`` event.
        ``timeout_s``: by default ``send_timeout_s`` (the link's rate and a margin).
        ``signed``: the end-to-end signature of a message this node relays (else it signs);
        ``answer_headers`` then receives the destination's signature of its answer."""
        if timeout_s is None:
            timeout_s = self.send_timeout_s(dest, len(body))
        try:
            hop = self.hop_to(dest)
            with self.phases.timed("send"):
                answer = self.transport.post(hop, dest, path, body, content_type, timeout_s, retries, ttl, signed,
                                             answer_headers)
        except (ConnectionError, OSError, AuthFailed) as e:
            self.ctx.events.write("send_failed", round=round_no, peer=dest, error=str(e))
            return None
        with self._traffic_lock:
            self.traffic.sent[hop] += len(body)
        return answer

    def post_weights(self, peer: str, path: str, round_no: int, weights: Optional[Weights] = None,
                     meta: Optional[dict[str, Any]] = None, timeout_s: Optional[float] = None,
                     retries: int = 1) -> bool:
        """Send weights (the model's by default) to ``peer``; False after a ``send_failed`` event."""
        body = self.weights_body(round_no, weights, meta)
        return self.post(peer, path, body, wire.CONTENT_TYPE, round_no, timeout_s, retries) is not None

    def weights_body(self, round_no: int, weights: Optional[Weights] = None,
                     meta: Optional[dict[str, Any]] = None) -> bytes:
        """A weights message of ``weights`` (the model's by default) from this node."""
        arrays = self.ctx.model.get_weights() if weights is None else weights
        return wire.encode(arrays, {"from": self.ctx.name, "round": round_no, "samples": self.samples, **(meta or {})},
                           self.weight_names if len(arrays) == len(self.weight_names or ()) else None)

    def count_received(self, req: Request, fallback: str) -> None:
        hop = req.hop or fallback
        with self._traffic_lock:
            self.traffic.recv[hop] += len(req.body)

    def count_sent_answer(self, req: Request, answer: bytes) -> None:
        """An answer body goes back to the hop the request came from."""
        with self._traffic_lock:
            self.traffic.sent[req.hop or "?"] += len(answer)

    def reject(self, req: Request, peer: str, reason: str, status: int = 400, error: str = "bad_weights") -> HttpError:
        """A ``rejected_update`` event, and the error to answer with."""
        self.ctx.events.write("rejected_update", peer=peer, path=req.path, reason=reason)
        return HttpError(status, error, reason)

    def require_sender(self, req: Request, allowed: Iterable[str], what: str) -> str:
        """The message's (verified) sender, when it is one of ``allowed``."""
        allowed = set(allowed)
        if req.sender not in allowed:
            raise self.reject(req, req.sender, f"{req.sender or 'an unsigned sender'} may not send {what} to "
                                               f"{self.ctx.name}", 403, "forbidden")
        return req.sender

    def receive_weights(self, req: Request, spec: Optional[Callable[[dict[str, Any]], Optional[wire.Spec]]] = None
                        ) -> tuple[str, Weights, dict[str, Any]]:
        """Decode a weights message from its verified sender, check it against the model
        (or against ``spec(meta)``), and count its bytes against the hop it came from."""
        peer = req.sender or "?"
        try:
            arrays, meta = wire.decode(req.body)
        except wire.WeightsFormatError as e:
            raise self.reject(req, peer, str(e)) from None
        try:
            expected = spec(meta) if spec is not None else self.spec
        except HttpError as e:
            raise self.reject(req, peer, e.detail, e.status, e.error) from None
        if expected is not None:
            problem = wire.problem(arrays, expected)
            if problem:
                raise self.reject(req, peer, problem)
        self.count_received(req, peer)
        return peer, arrays, meta

    def relay(self, req: Request) -> Response:
        """``POST /relay?to=DEST&path=PATH``: pass a message on towards ``DEST``, with its
        end-to-end signature untouched (``DEST`` checks it), and ``DEST``'s answer back with its
        signature (the sender checks it)."""
        dest, path = req.query.get("to", ""), req.query.get("path", "")
        if not path.startswith("/") or path.startswith("/relay") or not path.replace("/", "").replace("_", "").isalnum():
            raise HttpError(400, "bad_relay", f"cannot relay to path {path!r}")
        try:
            ttl = int(req.headers.get(TTL_HEADER.lower(), MAX_RELAYS)) - 1
        except ValueError:
            raise HttpError(400, "bad_relay", "bad TTL header") from None
        if ttl <= 0:
            raise HttpError(508, "relay_loop", f"message for {dest} relayed too often")
        signed = {name: req.headers.get(name.lower(), "") for name in E2E}
        if not all(signed.values()):
            raise HttpError(401, "unauthorized", "a relayed message needs its sender's signature")
        self.count_received(req, "?")
        answer = self.post(dest, path, req.body, req.content_type or "application/octet-stream", -1, ttl=ttl,
                           signed=signed, timeout_s=max(self.send_timeout_s(dest, len(req.body)), RELAY_WAIT_S),
                           retries=0, answer_headers=req.answer_headers)  # (dest's signature, passed back)
        if answer is None:
            raise HttpError(502, "relay_failed", f"{self.ctx.name} could not pass the message on to {dest}")
        with self._traffic_lock:
            self.traffic.recv[self.next_hop.get(dest, dest)] += len(answer)
        self.count_sent_answer(req, answer)
        return 200, "application/octet-stream", answer


def ok(data: Optional[dict[str, Any]] = None) -> Response:
    return json_response({"ok": True, **(data or {})})
