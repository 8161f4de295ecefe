"""Gossip learning, as in EdgeTB: average what arrived with the local model, train,
evaluate, send to one random out-neighbour.

A round starts when at least one model has arrived, or after ``wait_s`` without
one (so a node whose neighbours fell silent still finishes). A failed send is
retried with another neighbour; gossip goes on with what arrives. A node stops
after ``sync`` rounds.
"""
from __future__ import annotations

import queue
import random
from typing import Callable

import numpy as np

from dml_app.http import Request, Response
from dml_app.roles.base import Context, Role, Weights, ok


class GossipRole(Role):
    name = "gossip"
    ROUTES = (("POST", "/gossip"),)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.inbox: "queue.Queue[tuple[str, Weights]]" = queue.Queue()
        self.wait_s = float(ctx.conf.get("wait_s", 10.0))
        self.rng = random.Random(f"{ctx.name}-{ctx.conf.get('seed', 0)}")

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/gossip"): self.on_gossip}

    def on_gossip(self, req: Request) -> Response:
        peer, arrays, _ = self.receive_weights(req)
        if not self.ctx.stop.is_set():
            self.inbox.put((peer, arrays))
        return ok()

    def gather(self, round_no: int) -> list[tuple[str, Weights]]:
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

    def combine(self, round_no: int, received: list[tuple[str, Weights]]) -> None:
        if not received:
            return
        models = [self.ctx.model.get_weights()] + [w for _, w in received]
        self.ctx.model.set_weights([np.mean(layer, axis=0) for layer in zip(*models)])

    def send(self, round_no: int) -> None:
        peers = list(self.connect)
        self.rng.shuffle(peers)
        for peer in peers:
            if self.post_weights(peer, "/gossip", round_no):
                return

