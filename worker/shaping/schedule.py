"""A recorded trace's schedule ticked by the worker's own clock (issue 48's skew).

The controller's replay sends one ``set_rates`` request a tick; its skew is that request's path
(HTTP, the body checked, messages built, the state saved). Here the worker gets every link's
bins once (``LinkSchedule``: rates, optional delay/loss, ``bin_ms``, ``loop``, ``offset_s``)
and a common start (a monotonic time of this host), builds each bin's netlink requests up front
(``prebuild``: one list of messages a link and bin), and a thread at nice -10 applies, at each
tick ``start + k * tick_s`` (absolute: a late tick does not shift the next), the bins that
changed: one netlink batch per node, on sockets kept open per namespace (``RateSockets``). No
state is saved per tick; ``applied`` (each link's last bin) is what the caller stores when the
schedule stops. Each tick is a row (``ROW_FIELDS``, as the controller's ``trace_ticks.csv``).

Not yet wired to an HTTP route or to the controller's ``TraceReplay``: see the issue's report.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from worker.api.errors import ConfigError
from worker.api.shape import Shape
from worker.kernel import netlink as nl
from worker.shaping.plan import ACCESS_MINOR, netem_limit_pkts
from worker.shaping.rates import RateSockets, urgent

ROW_FIELDS = ("planned_s", "applied_s", "skew_ms", "links", "changed", "outcome")
MAX_BINS = 200_000  # every link's bins together: the messages built up front stay tens of MB at most
MIN_BIN_MS = 10
KEEP_ROWS = 100_000


@dataclass(frozen=True)
class LinkSchedule:
    """Link ``src -> dst``'s bins: rate (bit/s) and, with a recording's columns, (delay ms, loss %)."""

    src: str
    dst: str
    rates_bps: tuple[int, ...]
    netem: Optional[tuple[tuple[float, float], ...]] = None
    bin_ms: int = 100
    loop: bool = False
    offset_s: float = 0.0  # where in the recording the link starts

    def value(self, k: int) -> tuple[int, Optional[tuple[float, float]]]:
        """Bin ``k``'s rate and delay/loss (a bin equal to the one applied is not sent again)."""
        return self.rates_bps[k], (self.netem[k] if self.netem is not None else None)

    def index_at(self, t_s: float) -> int:
        """The bin at ``t_s`` seconds after the start (the last one held when it does not loop)."""
        k = int((max(0.0, t_s) + self.offset_s) * 1000 // self.bin_ms + 1e-9)
        n = len(self.rates_bps)
        return k % n if self.loop else min(k, n - 1)


def check(links: list[LinkSchedule]) -> None:
    """Refuse a schedule that is too large or malformed, naming the link, before anything runs."""
    total = 0
    seen = set()
    for i, link in enumerate(links):
        where = f"schedule: links[{i}] ({link.src}->{link.dst})"
        if (link.src, link.dst) in seen:
            raise ConfigError(f"{where}: listed twice")
        seen.add((link.src, link.dst))
        if not link.rates_bps:
            raise ConfigError(f"{where}: no bins")
        if link.bin_ms < MIN_BIN_MS:
            raise ConfigError(f"{where}: bin_ms {link.bin_ms} under {MIN_BIN_MS}")
        if any(not isinstance(r, int) or r < 8 for r in link.rates_bps):
            raise ConfigError(f"{where}: a rate is not an integer of at least 8 bit/s")
        if link.netem is not None and len(link.netem) != len(link.rates_bps):
            raise ConfigError(f"{where}: {len(link.netem)} delay/loss bins for {len(link.rates_bps)} rates")
        if link.offset_s < 0:
            raise ConfigError(f"{where}: a negative offset")
        total += len(link.rates_bps)
    if total > MAX_BINS:
        raise ConfigError(f"schedule: {total} bins, more than {MAX_BINS}")


def prebuild(link: LinkSchedule, ifindex: int, rule: dict[str, Any], uplink_bps: Optional[int],
             rules: int) -> list[list[bytes]]:
    """Each bin's requests for ``link`` (``rule``: its stored plan rule), as ``rates.rate_messages``
    builds them: its HTB class (an uplink's share) and, when it has one, its netem leaf."""
    old = rule["shape"]
    minor = int(rule["minor"])
    out = []
    for k, rate_bps in enumerate(link.rates_bps):
        rate = max(8, min(rate_bps, int(uplink_bps) // max(1, rules))) if uplink_bps else rate_bps
        msgs = [nl.htb_class(ifindex, minor, rate, 0, ceil_bps=rate_bps, parent_minor=ACCESS_MINOR)]
        delay, loss = link.netem[k] if link.netem is not None else (old.get("delay_ms") or 0.0,
                                                                    old.get("loss_pct") or 0.0)
        if link.netem is not None or any(old.get(f) for f in ("delay_ms", "jitter_ms", "loss_pct")):
            shape = Shape.from_dict({**old, "rate_bps": rate_bps, "delay_ms": delay, "loss_pct": loss})
            msgs.append(nl.netem_leaf(ifindex, minor, shape.delay_ms, shape.jitter_ms, shape.loss_pct,
                                      netem_limit_pkts(shape)))
        out.append(msgs)
    return out


class ScheduleClock:
    """``links`` ticked from monotonic time ``start`` on this host by a thread of its own.

    ``nodes``: each source node's ``(netns, plan)`` (the stored plan: ``Plan.to_dict``)."""

    def __init__(self, links: list[LinkSchedule], nodes: dict[str, tuple[Optional[str], dict[str, Any]]],
                 start: float, sockets: Optional[RateSockets] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        check(links)
        self.links = links
        self.start = start
        self.clock = clock
        self.sockets = sockets or RateSockets()
        self._own_sockets = sockets is None
        self.tick_s = min(link.bin_ms for link in links) / 1000 if links else 0.1
        self._where: dict[str, tuple[Optional[str], str]] = {}  # node: its namespace, interface
        self._bins: list[list[list[bytes]]] = []  # per link: per bin, its requests
        for link in links:
            if link.src not in nodes:
                raise ConfigError(f"schedule: no node {link.src!r} on this host")
            netns, plan = nodes[link.src]
            rule = next((r for r in plan["rules"] if r["dest"] == link.dst), None)
            if rule is None:
                raise ConfigError(f"schedule: no shaped link {link.src}->{link.dst} on this host")
            _, ifindex = self.sockets.get(netns, plan["ifname"])
            self._where[link.src] = (netns, plan["ifname"])
            self._bins.append(prebuild(link, ifindex, rule, plan.get("uplink_bps"), len(plan["rules"])))
        self.applied: list[int] = [-1] * len(links)  # each link's bin in the kernel (-1: none yet)
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    def tick(self, planned_s: float) -> int:
        """Apply the bins of ``planned_s`` that differ from those applied: one batch per node."""
        batches: dict[str, list[tuple[int, int]]] = {}
        for i, link in enumerate(self.links):
            k = link.index_at(planned_s)
            if k != self.applied[i] and (self.applied[i] < 0 or link.value(k) != link.value(self.applied[i])):
                batches.setdefault(link.src, []).append((i, k))
        outcome = "applied"
        changed = 0
        for src, todo in batches.items():
            msgs = [m for i, k in todo for m in self._bins[i][k]]
            sock, _ = self.sockets.get(*self._where[src])  # (open: made in __init__)
            try:
                failures = sock.run(msgs)
            except OSError as e:
                failures = [nl.Failure(0, e.errno or 0, str(e))]
            if failures:
                outcome = f"failed: {src}: {failures[0].describe()}"
                continue
            for i, k in todo:
                self.applied[i] = k
            changed += len(todo)
        applied_s = self.clock() - self.start
        with self._lock:
            self.rows.append({"planned_s": round(planned_s, 4), "applied_s": round(applied_s, 4),
                              "skew_ms": round((applied_s - planned_s) * 1000, 2), "links": len(self.links),
                              "changed": changed, "outcome": outcome})
            if len(self.rows) > KEEP_ROWS:
                del self.rows[:KEEP_ROWS // 2]
        return changed

    def run(self) -> None:
        """Tick until ``stop``: at ``start + k * tick_s``, a late tick catching up to the grid."""
        with urgent():
            k = max(0, int((self.clock() - self.start) / self.tick_s))
            while not self._stop.is_set():
                due = self.start + k * self.tick_s
                wait = due - self.clock()
                if wait > 0 and self._stop.wait(wait):
                    return
                self.tick(k * self.tick_s)
                behind = int((self.clock() - self.start) / self.tick_s)
                k = max(k + 1, behind)  # a tick missed is skipped (its bins come with the next)

    def begin(self) -> None:
        self._thread = threading.Thread(target=self.run, name="edgetb-schedule-clock", daemon=True)
        self._thread.start()

    def stop(self) -> dict[tuple[str, str], int]:
        """Stop ticking; each link's last applied bin (what the caller stores as its plan's)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._own_sockets:
            self.sockets.close()
        return {(l.src, l.dst): k for l, k in zip(self.links, self.applied) if k >= 0}

    def rows_since(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.rows[n:]
