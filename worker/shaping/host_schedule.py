"""The agent's one trace clock (``HostSchedule``): the schedules of ``worker.shaping.schedule``
ticked in a child process of their own (``worker.shaping.clock_process``)."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from worker.api.errors import ConfigError, TestbedError
from worker.shaping.clock_process import ClockProcess, link_json
from worker.shaping.schedule import MAX_LINKS, LinkSchedule, parse

log = logging.getLogger("edgetb.schedule")


@dataclass
class RunningClock:
    """What the agent knows of the clock its child process runs: its links, what it ended."""

    links: list[LinkSchedule]
    tick_s: float
    ended: set[tuple[str, str]]

    def end(self, keys: set[tuple[str, str]]) -> None:
        self.ended.update(keys)


class HostSchedule:
    """The agent's one running clock (``store``: the agent's ``StateStore``), ticked in a child
    process (``worker.shaping.clock_process``): kept between schedules once ``warm`` (the agent:
    a start does not wait for its imports), ended at ``stop`` otherwise."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.clock: Optional[RunningClock] = None
        self._lock = threading.Lock()
        self._proc: Any = None  # clock_process.ClockProcess
        self._keep = False

    def warm(self) -> None:
        """Start the clock's process now and keep it (the agent, at its start)."""
        with self._lock:
            self._keep = True
            self._process()

    def _process(self) -> Any:
        if self._proc is None or not self._proc.alive():
            self._proc = ClockProcess()
        return self._proc

    def _close(self) -> None:
        if self._proc is not None:
            self._proc.close()
            self._proc = None

    def _call(self, cmd: dict[str, Any]) -> Optional[dict[str, Any]]:
        """``cmd`` to the running clock's process; None when that process is gone (said in the
        log: its links keep the bins the kernel holds)."""
        if self._proc is None or not self._proc.alive():
            log.warning("trace clock: its process is gone; the traced links keep their last bins")
            return None
        try:
            return self._proc.call(cmd)
        except ConfigError:
            raise
        except TestbedError as e:
            log.warning("trace clock: %s", e.message)
            return None

    def start(self, body: Any) -> dict[str, Any]:
        """Check ``body`` (``parse``) and every link against this host's plans, then tick from its
        start; a clock running already is stopped first (its bins stored)."""
        links, start_wall_s = parse(body)
        state = self.store.snapshot()
        nodes = {}
        for link in links:
            if link.src not in state["nodes"] or not state["plans"].get(link.src):
                raise ConfigError(f"schedule: no shaped node {link.src!r} on this host")
            nodes[link.src] = [state["nodes"][link.src]["netns"], state["plans"][link.src]]
        start = time.monotonic() + (start_wall_s - time.time())
        with self._lock:
            proc = self._process()
            try:  # (the child refuses a link not shaped here before it stops a running clock)
                answer = proc.call({"op": "start", "start": start, "links": [link_json(l) for l in links],
                                    "nodes": nodes})
            except ConfigError:
                if self.clock is None and not self._keep:
                    self._close()
                raise
            previous = self._store_locked(self.clock, answer["previous"]) if self.clock is not None else None
            self.clock = RunningClock(links, answer["tick_s"], set())
        return {"links": len(links), "tick_s": answer["tick_s"], "starts_in_s": round(start - time.monotonic(), 4),
                **({"replaced": previous["links"]} if previous else {})}

    def ticked(self, src: str) -> frozenset[str]:
        """The destinations of ``src``'s links the running clock ticks (none: no clock)."""
        clock = self.clock
        if clock is None:
            return frozenset()
        return frozenset(l.dst for l in clock.links if l.src == src and (l.src, l.dst) not in clock.ended)

    def end_node(self, node: str) -> None:
        """No longer tick the links from or to ``node`` (its links were cleared); the others go on."""
        with self._lock:
            if self.clock is not None:
                keys = {(l.src, l.dst) for l in self.clock.links if node in (l.src, l.dst)}
                self.clock.end(keys)
                if keys and self._proc is not None:
                    self._call({"op": "end", "links": [list(k) for k in keys]})

    def end(self, body: Any) -> dict[str, Any]:
        """``{"version": 1, "links": [{"src", "dst"}]}``: no longer ticked (a constant rate set on them)."""
        items = body.get("links") if isinstance(body, dict) else None
        if not isinstance(items, list) or len(items) > MAX_LINKS or \
                any(not isinstance(x, dict) or not isinstance(x.get("src"), str) or not isinstance(x.get("dst"), str)
                    for x in items):
            raise ConfigError("schedule end: links is not a list of {src, dst}")
        with self._lock:
            if self.clock is None:
                return {"running": False, "ended": []}
            answer = self._call({"op": "end", "links": [[x["src"], x["dst"]] for x in items]})
            if answer is None:
                return {"running": False, "ended": []}
            ended = [(s, d) for s, d in answer["ended"]]
            self.clock.end(set(ended))
        return {"running": True, "ended": [{"src": s, "dst": d} for s, d in ended]}

    def replanned(self, nodes: Optional[set[str]] = None) -> None:
        """The plans of ``nodes`` (all: None) changed (``set_links``): their links' requests are
        built again from the new plans and re-sent at the next tick."""
        with self._lock:
            clock = self.clock
            if clock is None:  # links shaped (a deploy): the clock's process is started, ready before a run's start
                try:
                    self._process()
                except OSError as e:
                    log.warning("the trace clock's process did not start (tried again at a schedule): %s", e)
                return
            state = self.store.snapshot()
            changed = {}
            for link in clock.links:
                if nodes is None or link.src in nodes:
                    node = state["nodes"].get(link.src) or {}
                    changed[link.src] = [node.get("netns"), state["plans"].get(link.src) if node else None]
            if changed:
                self._call({"op": "replan", "nodes": changed})

    def stop(self) -> dict[str, Any]:
        """Stop the clock; each link's last bin stored as its plan's; the ticks (``rows``)."""
        with self._lock:
            out = None
            if self.clock is not None:
                answer = self._call({"op": "stop"}) or {"running": False}
                out = self._store_locked(self.clock, answer)
                self.clock = None
            if not self._keep:
                self._close()
        return out or {"running": False, "links": 0, "rows": [], "applied": []}

    def _store_locked(self, clock: RunningClock, answer: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The clock's answer to its stop: each link's last bin stored as its plan's."""
        if not answer.get("running"):
            return None
        by_key = {(l.src, l.dst): l for l in clock.links}
        applied = {(s, d): k for s, d, k in answer["applied"] if (s, d) not in clock.ended}
        with self.store.locked() as fresh:
            for (src, dst), k in applied.items():
                rate, netem = by_key[(src, dst)].value(k)
                for rule in (fresh["plans"].get(src) or {}).get("rules", []):
                    if rule["dest"] == dst:
                        rule["shape"]["rate_bps"] = rate
                        if netem is not None:
                            rule["shape"]["delay_ms"], rule["shape"]["loss_pct"] = netem
        return {"running": True, "links": len(clock.links), "rows": answer["rows"], "policy": answer.get("policy"),
                "applied": [{"src": s, "dst": d, "bin": k, "rate_bps": by_key[(s, d)].rates_bps[k]}
                            for (s, d), k in applied.items()]}
