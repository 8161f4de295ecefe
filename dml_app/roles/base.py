"""The round loop, owned once; each algorithm fills in its hooks.

A round: ``gather`` what peers sent, ``combine`` it with the local model, train
locally, evaluate, ``send`` to peers, and write a ``round`` event. Failures are
data: a send that fails is an event, and the role decides what to do next.
"""
from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from dml_app import weights as wire
from dml_app.events import EventLog
from dml_app.http import HttpError, Request, Response, json_response, request

Weights = list[np.ndarray]


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
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass
class Traffic:
    """Bytes sent and received per peer, reset each round."""

    sent: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    recv: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def take(self) -> tuple[dict[str, int], dict[str, int]]:
        sent, recv = dict(self.sent), dict(self.recv)
        self.sent.clear()
        self.recv.clear()
        return sent, recv


class Role:
    """Base of every algorithm's role; subclasses override the hooks."""

    name = "role"
    ROUTES: tuple[tuple[str, str], ...] = ()  # (method, path) of the role's own endpoints

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.traffic = Traffic()
        self.rounds = int(ctx.conf.get("sync", 1))
        self.epochs = int(ctx.conf.get("epoch", 1))
        self.batch_size = int(ctx.dataset_conf.get("batch_size", 32))
        self.connect: dict[str, str] = dict(ctx.conf.get("connect", {}))  # peer -> "ip:port"
        self._traffic_lock = threading.Lock()

    # hooks -------------------------------------------------------------------------
    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        """Handlers of ``ROUTES``."""
        return {}

    def gather(self, round_no: int) -> list[tuple[str, Weights]]:
        return []

    def combine(self, round_no: int, received: list[tuple[str, Weights]]) -> None:
        pass

    def send(self, round_no: int) -> None:
        pass

    # the loop ------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        x_train, y_train, x_test, y_test = self.ctx.data
        last: dict[str, Any] = {}
        for r in range(1, self.rounds + 1):
            if self.ctx.stop.is_set():
                break
            t_start = time.time()
            received = self.gather(r)
            self.combine(r, received)
            trained = self.ctx.model.train(x_train, y_train, self.epochs, self.batch_size)
            loss, accuracy = self.ctx.model.evaluate(x_test, y_test)
            sent_at = time.perf_counter()
            self.send(r)
            send_s = time.perf_counter() - sent_at
            with self._traffic_lock:
                sent_to, recv_from = self.traffic.take()
            last = self.ctx.events.write(
                "round", round=r, t_start=t_start, t_end=time.time(), loss=loss, accuracy=accuracy,
                train_loss=trained["loss"], train_s=trained["train_s"], send_s=send_s,
                bytes_sent=sum(sent_to.values()), bytes_recv=sum(recv_from.values()),
                sent_to=sent_to, recv_from=recv_from, received_models=len(received))
            self.ctx.progress(f"round {r}/{self.rounds}: accuracy {accuracy:.3f} loss {loss:.3f}",
                              round=r, accuracy=accuracy)
        return {"rounds": last.get("round", 0), "accuracy": last.get("accuracy"), "loss": last.get("loss")}

    # helpers for subclasses -------------------------------------------------------------
    def post_weights(self, peer: str, path: str, round_no: int, timeout_s: float = 60.0) -> bool:
        """Send the model's weights to ``peer``; a failure becomes a ``send_failed`` event."""
        body = wire.encode(self.ctx.model.get_weights(), {"from": self.ctx.name, "round": round_no,
                                                          "samples": int(len(self.ctx.data[1]))})
        try:
            status, answer = request("POST", f"http://{self.connect[peer]}{path}", body, wire.CONTENT_TYPE,
                                     timeout_s=timeout_s, retries=1)
            if status >= 400:
                raise ConnectionError(f"{status}: {answer[:200]!r}")
        except (ConnectionError, OSError) as e:
            self.ctx.events.write("send_failed", round=round_no, peer=peer, error=str(e))
            return False
        with self._traffic_lock:
            self.traffic.sent[peer] += len(body)
        return True

    def receive_weights(self, req: Request) -> tuple[str, Weights, dict[str, Any]]:
        """Decode a weights upload and count its bytes against the sender."""
        try:
            arrays, meta = wire.decode(req.body)
        except wire.WeightsFormatError as e:
            raise HttpError(400, "bad_weights", str(e)) from None
        peer = str(meta.get("from", "?"))
        with self._traffic_lock:
            self.traffic.recv[peer] += len(req.body)
        return peer, arrays, meta


def ok(data: Optional[dict[str, Any]] = None) -> Response:
    return json_response({"ok": True, **(data or {})})
