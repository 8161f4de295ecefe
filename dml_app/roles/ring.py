"""Ring all-reduce: every node trains, then the ring averages the models exactly.

The weights are flattened into one vector and cut with ``np.array_split`` into
one chunk per node (a layer smaller than the ring is no special case: every
element is in some chunk). Reduce-scatter: in n - 1 steps each node passes a
partial sum on to its successor and adds what its predecessor passed it, so
each node ends up owning the full sum of one chunk, which it divides by n.
All-gather: n - 1 more steps pass the finished chunks around. Partial sums
travel as float64 and finished chunks in the model's dtype, so the result is
the elementwise mean rounded once. A step that cannot send, or waits longer than ``step_timeout_s``,
aborts the run cleanly (the node reports failed; its neighbours time out too).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from dml_app.http import HttpError, Request, Response
from dml_app.roles.base import Context, Role, Weights, ok


class RingAborted(RuntimeError):
    """The ring lost a neighbour: this round cannot finish."""


def split(weights: Weights, n: int) -> list[np.ndarray]:
    """The weights as one float64 vector cut into ``n`` chunks (some may be empty)."""
    flat = np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in weights])
    return [chunk.copy() for chunk in np.array_split(flat, n)]


def join(chunks: list[np.ndarray], like: Weights) -> Weights:
    """Chunks back into arrays shaped and typed like ``like``."""
    flat = np.concatenate(chunks)
    out, at = [], 0
    for w in like:
        out.append(flat[at:at + w.size].reshape(w.shape).astype(w.dtype))
        at += w.size
    return out


class RingRole(Role):
    name = "ring"
    ROUTES = (("POST", "/ring/chunk"),)

    def __init__(self, ctx: Context) -> None:
        super().__init__(ctx)
        self.ring: list[str] = list(ctx.conf["ring"])
        self.pos = self.ring.index(ctx.name)
        self.n = len(self.ring)
        self.successor = self.ring[(self.pos + 1) % self.n]
        self.predecessor = self.ring[self.pos - 1]
        # chunk sizes of the flattened model (as np.array_split cuts it); none without a model
        elements = 0 if self.spec is None else sum(int(np.prod(s)) for s, _ in self.spec)
        self.chunk_sizes = None if self.spec is None else [
            len(c) for c in np.array_split(np.empty(elements, dtype=np.uint8), self.n)]
        self.step_timeout_s = float(ctx.conf.get("step_timeout_s", 120.0))
        self._arrived: dict[tuple[int, str, int], np.ndarray] = {}
        self._cond = threading.Condition()

    def routes(self) -> dict[tuple[str, str], Callable[[Request], Response]]:
        return {("POST", "/ring/chunk"): self.on_chunk}

    def on_chunk(self, req: Request) -> Response:
        self.require_sender(req, [self.predecessor], "a chunk")
        peer, arrays, meta = self.receive_weights(req, self.chunk_spec)
        if len(arrays) != 1:
            raise self.reject(req, peer, "a chunk is one array", error="bad_chunk")
        key = (int(meta["round"]), str(meta["phase"]), int(meta["step"]))
        with self._cond:
            self._arrived[key] = arrays[0]
            self._cond.notify_all()
        return ok()

    def chunk_spec(self, meta: dict[str, Any]) -> Optional[list[tuple[tuple[int, ...], str]]]:
        """What the predecessor's chunk for (phase, step) must be: one 1-D array, float64
        partial sums in reduce-scatter, the model's dtype in all-gather."""
        phase, step, round_no = meta.get("phase"), meta.get("step"), meta.get("round")
        if phase not in ("reduce", "gather") or not isinstance(step, int) or not 0 <= step < self.n - 1 \
                or not isinstance(round_no, int):
            raise HttpError(400, "bad_chunk", "a chunk needs round, phase (reduce or gather) and step")
        if self.spec is None or self.chunk_sizes is None:
            return None  # no model to check against (in-memory tests)
        p = (self.pos - 1) % self.n
        index = (p - step) % self.n if phase == "reduce" else (p + 1 - step) % self.n
        dtype = "<f8" if phase == "reduce" else np.result_type(*[np.dtype(d) for _, d in self.spec]).str
        return [((self.chunk_sizes[index],), dtype)]

    def _take(self, key: tuple[int, str, int]) -> np.ndarray:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._arrived or self.ctx.stop.is_set(),
                                       timeout=self.step_timeout_s) or key not in self._arrived:
                raise RingAborted(f"no {key[1]} chunk of round {key[0]} step {key[2]} from "
                                  f"{self.ring[self.pos - 1]} within {self.step_timeout_s:g}s")
            return self._arrived.pop(key)

    def _pass(self, round_no: int, phase: str, step: int, chunk: np.ndarray) -> None:
        if not self.post_weights(self.successor, "/ring/chunk", round_no, weights=[chunk],
                                 meta={"phase": phase, "step": step}, timeout_s=self.step_timeout_s):
            raise RingAborted(f"could not pass the {phase} chunk of step {step} to {self.successor}")

    def all_reduce(self, round_no: int, weights: Weights) -> Weights:
        """The elementwise mean of every ring member's ``weights``."""
        n, i = self.n, self.pos
        chunks = split(weights, n)
        for step in range(n - 1):  # reduce-scatter: partial sums in float64
            self._pass(round_no, "reduce", step, chunks[(i - step) % n])
            chunks[(i - step - 1) % n] += self._take((round_no, "reduce", step))
        mine = (i + 1) % n
        chunks[mine] = (chunks[mine] / n).astype(np.result_type(*weights))  # rounded once
        for step in range(n - 1):  # all-gather: finished chunks, in the model's dtype
            self._pass(round_no, "gather", step, chunks[(i + 1 - step) % n])
            chunks[(i - step) % n] = self._take((round_no, "gather", step))
        return join(chunks, weights)

    def run(self) -> dict[str, Any]:
        last: dict[str, Any] = {}
        for r in range(1, self.rounds + 1):
            if self.ctx.stop.is_set():
                break
            t_start = time.time()
            trained = self.train_local()
            reduced_at = time.perf_counter()
            self.ctx.model.set_weights(self.all_reduce(r, self.ctx.model.get_weights()))
            send_s = time.perf_counter() - reduced_at
            loss, accuracy = self.evaluate()
            last = self.record_round(r, t_start, trained, loss, accuracy, send_s, self.n - 1)
        return self.result(last)
