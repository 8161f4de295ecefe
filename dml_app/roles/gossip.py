"""Gossip learning, as in EdgeTB: average what arrived with the local model, train,
evaluate, send to one random out-neighbour.

A round starts when at least one model has arrived. How long a node waits for one
(``wait_policy``):

- ``adaptive`` (the default): not at all once every in-neighbour that could send
  (``senders``) has said it is done; otherwise until ``WAIT_GAPS`` median gaps between the
  recent arrivals have passed since the last one (before enough arrivals: ``WAIT_GAPS``
  times the node's own last round of work), at least ``MIN_WAIT_S``, never over ``wait_s``.
  A model that comes later is combined next round.
- ``fixed`` (EdgeTB's): up to ``wait_s`` (default 10 s) whatever the neighbours do.

The inbox holds one model per peer: a model that comes while the same peer's last one is
still waiting replaces it (``replaced`` in the answer), so no peer weighs more than one
neighbour in an average, and what a node holds is bounded by its peers, not by what they send.

Once its last round has gathered its models, a node refuses more and tells its
out-neighbours it is done (``/gossip/done``); they send it nothing more. A send that a
finished peer refuses goes to another out-neighbour. Once a node has heard of a finished
neighbour, its models go with ``Expect: 100-continue``: a refusal then comes from the call's
headers, before the model crosses the link.

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
import statistics
import threading
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from dml_app.roles.base import Context, Role, RoundRecord, Weights, ok
from dml_app.roles.shared import PeerHealth, parallel
from dml_app.runtime.http import JSON, Request, Response
from dml_app.wire import bounded_json
from dml_app.wire import weights as wire

WAIT_POLICIES = ("adaptive", "fixed")
WAIT_GAPS = 1.0  # an adaptive wait ends this many median arrival gaps after the last arrival
MIN_WAIT_S = 0.2  # the shortest adaptive wait (arrivals in a burst have gaps near 0)
GAPS_KEPT = 16  # the recent arrival gaps the median is taken over
GAPS_NEEDED = 3  # fewer known gaps: the wait is set by the node's own last round of work
DONE = None  # an inbox item meaning: a sender said it is done
ARRIVED = ()  # an inbox item meaning: a model from that peer is in ``pending``


class GossipRole(Role):
    name = "gossip"
    ROUTES = (("POST", "/gossip"), ("POST", "/gossip/done"))
    SMALL_ROUTES = frozenset({"/gossip/done"})

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.inbox: "queue.Queue[tuple[str, Optional[tuple]]]" = queue.Queue()  # ARRIVED and DONE notices
        self.pending: dict[str, Weights] = {}  # each peer's latest model not yet combined (under _lock)
        self.wait_s = float(ctx.conf.get("wait_s", 10.0))
        self.wait_policy = str(ctx.conf.get("wait_policy", "adaptive"))
        if self.wait_policy not in WAIT_POLICIES:
            raise ValueError(f"wait_policy must be one of {', '.join(WAIT_POLICIES)}, not {self.wait_policy!r}")
        # the in-neighbours that send to this node (None: not known, so never all done)
        senders = ctx.conf.get("senders")
        self.senders: Optional[frozenset[str]] = None if senders is None else frozenset(map(str, senders))
        self.done_senders: set[str] = set()
        self.done_peers: set[str] = set()  # out-neighbours that finished: sent nothing more
        self.arrivals: "deque[float]" = deque(maxlen=GAPS_KEPT + 1)  # monotonic times of recent models
        self.work_s = 0.0  # the last round's time without its wait (combine, train, evaluate, send)
        self.closing = False  # in the last round, past its gather: models are refused
        self._told = False  # the done notices went out
        self._lock = threading.Lock()
        self.rng = random.Random(f"{ctx.name}-{ctx.conf.get('seed', 0)}")
        self.health = PeerHealth()
        self.round_no = 0

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/gossip"): self.on_gossip, ("POST", "/gossip/done"): self.on_done}

    def early_answer(self, key: tuple[str, str], req: Request) -> Optional[Response]:
        """A model sent once this node takes no more is refused before it crosses the link."""
        return self.refusal() if key == ("POST", "/gossip") else None

    def refusal(self) -> Optional[Response]:
        return ok({"accepted": False}) if self.finished or self.closing or self.ctx.stop.is_set() else None

    def on_gossip(self, req: Request) -> Response:
        peer, arrays, _ = self.receive_weights(req)
        if self.health.alive(peer):
            self.ctx.events.write("peer_rejoined", round=self.round_no, peer=peer, how="sent a model")
        refused = self.refusal()
        if refused is not None:
            return refused
        return ok({"accepted": True, "replaced": True}) if self.deliver(peer, arrays) else ok()

    def deliver(self, peer: str, arrays: Weights) -> bool:
        """Keep ``peer``'s model for the next gather; whether it replaced one still waiting."""
        with self._lock:
            self.arrivals.append(time.monotonic())
            replaced = peer in self.pending
            self.pending[peer] = arrays
        if not replaced:
            self.inbox.put((peer, ARRIVED))
        return replaced

    def on_done(self, req: Request) -> Response:
        """An in-neighbour ran its last round: it sends nothing more."""
        if self.senders is None:  # not known: nothing to keep track of
            return ok()
        peer = self.require_sender(req, self.senders, "the end of its rounds")
        with self._lock:
            self.done_senders.add(peer)
        self.expect_refusals()
        self.inbox.put((peer, DONE))
        return ok()

    def round(self, round_no: int) -> RoundRecord:
        """Average what arrived with the local model, train, evaluate, send on."""
        t_start = time.time()
        started = time.monotonic()
        received = self.gather(round_no, started)
        waited_s = time.monotonic() - started
        if round_no == self.sync:  # nothing that comes now would be used: say so at once
            self.closing = True
            threading.Thread(target=self.tell_done, name="gossip-done", daemon=True).start()
        self.combine(received)
        trained = self.train_local()
        loss, accuracy = self.evaluate(round_no)
        sent_at = time.perf_counter()
        self.send(round_no)
        self.work_s = time.monotonic() - started - waited_s
        return RoundRecord(round_no, t_start, trained, loss, accuracy, time.perf_counter() - sent_at, len(received),
                           {"waited_s": round(waited_s, 4)})

    def gather(self, round_no: int, since: float) -> list[tuple[str, Weights]]:
        """What peers sent: nothing in round 1, else what is in the inbox, or the first model
        to come within the wait (``wait_policy``; none when no sender can send any more)."""
        self.round_no = round_no
        if round_no == 1:
            return []
        received = self._take()
        while not received:
            remaining = self.wait_deadline(since) - time.monotonic()
            if remaining <= 0 or self.all_senders_done():
                return []
            try:
                item = self.inbox.get(timeout=remaining)
            except queue.Empty:
                return []
            received = self._take()
        return received

    def _take(self) -> list[tuple[str, Weights]]:
        """The models waiting now, one per peer (the inbox's notices are spent)."""
        while True:
            try:
                self.inbox.get_nowait()
            except queue.Empty:
                break
        with self._lock:
            out, self.pending = list(self.pending.items()), {}
        return out

    def all_senders_done(self) -> bool:
        """Whether every in-neighbour has said it is done (False when they are not known)."""
        if self.wait_policy == "fixed" or self.senders is None:
            return False
        with self._lock:
            return self.senders <= self.done_senders

    def wait_deadline(self, since: float) -> float:
        """When the wait that starts at ``since`` ends (monotonic): ``wait_s`` later (``fixed``), else
        ``WAIT_GAPS`` median arrival gaps after the last arrival (too few arrivals seen:
        ``WAIT_GAPS`` times the last round's work after ``since``), at least ``MIN_WAIT_S`` and at
        most ``wait_s`` after ``since``."""
        longest = since + self.wait_s
        if self.wait_policy == "fixed":
            return longest
        with self._lock:
            times = list(self.arrivals)
        if len(times) <= GAPS_NEEDED:  # too few arrivals to know their pace: a round of this node's own work
            return min(longest, since + max(MIN_WAIT_S, WAIT_GAPS * self.work_s)) if self.work_s else longest
        gap = statistics.median(b - a for a, b in zip(times, times[1:]))
        return min(longest, max(since + MIN_WAIT_S, times[-1] + WAIT_GAPS * gap))

    def combine(self, received: list[tuple[str, Weights]]) -> None:
        """The local model and the received ones, averaged."""
        if not received:
            return
        models = [self.ctx.model.get_weights()] + [w for _, w in received]
        self.ctx.model.set_weights([np.mean(layer, axis=0) for layer in zip(*models)])

    def send(self, round_no: int) -> None:
        """The model to one random peer that takes it (one in a back-off is skipped, one that
        has finished, or has said so, is not tried)."""
        with self._lock:  # a finished sender is (on a two-way link) a finished receiver too
            finished = self.done_peers | self.done_senders
        peers = [p for p in self.connect if p not in finished]
        self.rng.shuffle(peers)
        for peer in self.health.usable(peers):
            answer = self.post_weights_answer(peer, round_no)
            if answer is None:
                newly, backoff = self.health.failed(peer)
                if newly:
                    self.ctx.events.write("peer_dropped", round=round_no, peer=peer, retry_in_s=backoff)
                continue
            if self.health.alive(peer):
                self.ctx.events.write("peer_rejoined", round=round_no, peer=peer, how="took a model")
            if answer.get("accepted", True) or self.wait_policy == "fixed":
                return
            with self._lock:  # it has finished: the model goes to another
                self.done_peers.add(peer)
            self.expect_refusals()

    def expect_refusals(self) -> None:
        """Neighbours have begun to finish: from now on a model waits for the peer's ``100
        Continue`` (``Expect``), so that a finished peer refuses it before it crosses the link.
        Not before: under load, waiting for every peer to be scheduled costs more than it saves."""
        self.transport.expect_continue = True

    def post_weights_answer(self, peer: str, round_no: int) -> Optional[dict]:
        """Send the model to ``peer``; its answer (``{}`` when not JSON), None when the send failed."""
        answer = self.post(peer, "/gossip", self.weights_body(round_no), wire.CONTENT_TYPE, round_no, retries=0)
        if answer is None:
            return None
        try:
            parsed = bounded_json.loads(answer)  # a peer's answer: nesting bounded
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}

    def tell_done(self) -> None:
        """Tell the out-neighbours (once) that this node takes no more models and sends no more
        after its last round's: they neither send to it nor wait for it. Not with ``fixed``,
        nor in a stopped run (nobody waits then)."""
        with self._lock:
            if self._told or self.wait_policy == "fixed" or self.ctx.stop.is_set():
                return
            self._told = True
            told = [p for p in self.connect if p not in self.done_peers]
        parallel(lambda p: self.post(p, "/gossip/done", b"{}", JSON, self.round_no, timeout_s=10, retries=0), told)

    def finish(self, completed: bool) -> None:
        """Stop taking models; tell the out-neighbours, if the last round has not already."""
        super().finish(completed)
        self._take()  # (dropped)
        self.tell_done()

