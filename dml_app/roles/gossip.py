"""Gossip learning, as in EdgeTB: average what arrived with the local model, train,
evaluate, send to one random out-neighbour.

A round starts when at least one model has arrived, or after ``wait_s`` without
one (so a node whose neighbours fell silent still finishes). A node stops after
``sync`` rounds.

Nodes die and come back (a crash, a revocation, a cut link): a send that cannot
finish at the link's rate plus a margin is given up (``Role.send_timeout_s``),
the peer is then skipped (``peer_dropped``) and tried again after a back-off
that doubles up to ``MAX_BACKOFF_S``; a peer that takes a model again, or sends
one, is used again (``peer_rejoined``). A node whose rounds are done keeps
answering (and relaying) until the run ends, so that its neighbours never wait
on it; what it is sent then is dropped.
"""
from __future__ import annotations

import queue
import random
import time
from typing import Callable

import numpy as np

from dml_app.roles.base import Context, Role, RoundRecord, Weights, ok
from dml_app.roles.shared import PeerHealth
from dml_app.runtime.http import Request, Response


class GossipRole(Role):
    name = "gossip"
    ROUTES = (("POST", "/gossip"),)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.inbox: "queue.Queue[tuple[str, Weights]]" = queue.Queue()
        self.wait_s = float(ctx.conf.get("wait_s", 10.0))
        self.rng = random.Random(f"{ctx.name}-{ctx.conf.get('seed', 0)}")
        self.health = PeerHealth()
        self.round_no = 0

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/gossip"): self.on_gossip}

    def on_gossip(self, req: Request) -> Response:
        peer, arrays, _ = self.receive_weights(req)
        if self.health.alive(peer):
            self.ctx.events.write("peer_rejoined", round=self.round_no, peer=peer, how="sent a model")
        if self.finished or self.ctx.stop.is_set():
            return ok({"accepted": False})
        self.inbox.put((peer, arrays))
        return ok()

    def round(self, round_no: int) -> RoundRecord:
        """Average what arrived with the local model, train, evaluate, send on."""
        t_start = time.time()
        received = self.gather(round_no)
        self.combine(received)
        trained = self.train_local()
        loss, accuracy = self.evaluate()
        sent_at = time.perf_counter()
        self.send(round_no)
        return RoundRecord(round_no, t_start, trained, loss, accuracy, time.perf_counter() - sent_at, len(received))

    def gather(self, round_no: int) -> list[tuple[str, Weights]]:
        """What peers sent: nothing in round 1, else at least one model (or none after ``wait_s``)."""
        self.round_no = round_no
        if round_no == 1:
            return []
        received = []
        try:
            received.append(self.inbox.get(timeout=self.wait_s))
        except queue.Empty:
            return []
        while True:
            try:
                received.append(self.inbox.get_nowait())
            except queue.Empty:
                return received

    def combine(self, received: list[tuple[str, Weights]]) -> None:
        """The local model and the received ones, averaged."""
        if not received:
            return
        models = [self.ctx.model.get_weights()] + [w for _, w in received]
        self.ctx.model.set_weights([np.mean(layer, axis=0) for layer in zip(*models)])

    def send(self, round_no: int) -> None:
        """The model to one random peer that takes it (one in a back-off is skipped)."""
        peers = list(self.connect)
        self.rng.shuffle(peers)
        for peer in self.health.usable(peers):
            if self.post_weights(peer, "/gossip", round_no, retries=0):
                if self.health.alive(peer):
                    self.ctx.events.write("peer_rejoined", round=round_no, peer=peer, how="took a model")
                return
            newly, backoff = self.health.failed(peer)
            if newly:
                self.ctx.events.write("peer_dropped", round=round_no, peer=peer, retry_in_s=backoff)

    def finish(self, completed: bool) -> None:
        super().finish(completed)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self.inbox.get_nowait()
            except queue.Empty:
                return

