"""The host's telemetry sampler, held between requests: started, read and stopped on request.

Requests come checked for their version (``worker.host``); answers come without it.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

from worker.api.errors import NotFound
from worker.nodes.runtime import Runtime
from worker.state import StateStore

TELEMETRY_READ_LIMIT, TELEMETRY_READ_MAX = 100, 1000  # samples per telemetry read


class Telemetry:
    """At most one ``worker.observe.telemetry.Sampler`` of one testbed's nodes and links."""

    def __init__(self, store: StateStore, runtime: Runtime) -> None:
        self.store = store
        self.runtime = runtime
        self.sampler: Any = None  # worker.observe.telemetry.Sampler while sampling
        self._lock = threading.Lock()

    def start(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start sampling this host's nodes and links every ``period_ms`` (worker.observe.telemetry);
        a sampler already running at another period is replaced (its samples are dropped)."""
        from worker.observe.telemetry import DEFAULT_PERIOD_MS, Sampler, check_period_ms

        period_ms = check_period_ms(body.get("period_ms", DEFAULT_PERIOD_MS))
        with self._lock:
            current = self.sampler
            if current is not None and current.running and current.period_ms == period_ms and not body.get("restart"):
                return sampler_info(current)
            if current is not None:
                current.stop()
            self.sampler = Sampler(self.store, self.runtime.cgroups, period_ms)
            self.sampler.start()
            return sampler_info(self.sampler)

    def read(self, cursor: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        """The samples since ``cursor``, ``limit`` at most (100 by default, 1,000 at most; ask
        again from the answer's ``cursor``); ``lost`` says how many the ring overwrote first."""
        sampler = self.sampler
        if sampler is None:
            raise NotFound("telemetry is not started on this host")
        limit = TELEMETRY_READ_LIMIT if limit is None else max(1, min(limit, TELEMETRY_READ_MAX))
        return sampler.read(cursor, limit)

    def stop(self) -> dict[str, Any]:
        with self._lock:
            sampler, self.sampler = self.sampler, None
        if sampler is None:
            return {"stopped": False}
        sampler.stop()
        return {"stopped": True, **sampler_info(sampler)}


def sampler_info(sampler: Any) -> dict[str, Any]:
    return {"host": sampler.host_name, "period_ms": sampler.period_ms, "now_s": time.monotonic(),
            "started_s": sampler.started_mono, "cursor": sampler.ring.next_cursor,
            "sampler_cpu_s": round(sampler.cpu_s, 6), "samples_taken": sampler.samples, "running": sampler.running}
