"""A recorded trace's schedule ticked by the worker's own clock.

The controller's replay sends one ``set_rates`` request a tick; its skew is that request's path
(HTTP, the body checked, messages built, the state saved). Here the worker gets every link's
bins once (``LinkSchedule``: rates, optional delay/loss, ``bin_ms``, ``loop``, ``offset_s``)
and a common start (a monotonic time of this host), builds each bin's netlink requests ahead
of its tick (``bin_messages``, right after the tick before: a start does not wait for every
bin's), and a real-time thread (``realtime``:
SCHED_FIFO, nice -10 where that is not allowed) applies, at each tick ``start + k * tick_s``
(absolute: a late tick does not shift the next), the bins that changed: one netlink batch per
node, on sockets kept open per namespace (``RateSockets``). A clock that wakes late applies the
latest bins due and gives every tick it passed a row with that batch's time (``due_ticks``). No
state is saved per tick; ``applied`` (each link's last bin) is what the caller stores when the
schedule stops. Each tick is a row (``ROW_FIELDS``, as the controller's ``trace_ticks.csv``):
skew is the time the kernel answered the tick's last batch minus the tick's due time.

``worker.shaping.host_schedule.HostSchedule`` is the agent's side
(``WorkerHost.schedule_start/_end/_stop``: ``PUT``, ``PATCH`` and ``DELETE /links/schedule``): a body checked whole (``parse``) before anything
runs, a common start on the wall clock, links ended one by one when a constant rate is set on
them, the stored plan given each link's last applied bin when it stops (stop, ``/reset``). The
``ScheduleClock`` runs in a child process of its own (``clock_process``: no agent thread holds
its interpreter lock when a tick is due), started with the agent (``warm``). The clock lives in
memory: an agent restarted mid-run has none (its links keep the bins the kernel holds) and its
stop answers ``running: false``.
"""
from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from worker.api.errors import ConfigError, TestbedError
from worker.api.shape import Shape
from worker.kernel import netlink as nl
from worker.shaping.plan import ACCESS_MINOR, netem_limit_pkts
from worker.shaping.rates import URGENT_NICE, RateSockets, urgent

log = logging.getLogger("edgetb.schedule")
ROW_FIELDS = ("planned_s", "applied_s", "skew_ms", "links", "changed", "outcome")
MAX_BINS = 200_000  # every link's bins together: the messages built up front stay tens of MB at most
MIN_BIN_MS = 10
KEEP_ROWS = 100_000
JOIN_LATE_S = 10.0  # a start further in the past: ticked from the current bin on (no rows for the ticks before)
MIN_REST_S = 0.001  # the least a real-time clock sleeps between ticks, late or not: others get the core
CLOCK_RT_PRIORITY = 10  # SCHED_FIFO: ahead of every ordinary process, behind the kernel's interrupt threads (50)


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
        if not math.isfinite(link.offset_s) or link.offset_s < 0:
            raise ConfigError(f"{where}: offset_s {link.offset_s} is not a finite number of seconds from 0")
        total += len(link.rates_bps)
    if total > MAX_BINS:
        raise ConfigError(f"schedule: {total} bins, more than {MAX_BINS}")


def bin_messages(link: LinkSchedule, k: int, ifindex: int, rule: dict[str, Any], uplink_bps: Optional[int],
                 rules: int) -> list[bytes]:
    """Bin ``k``'s requests for ``link`` (``rule``: its stored plan rule), as ``rates.rate_messages``
    builds them: its HTB class (an uplink's share) and, when it has one, its netem leaf."""
    old = rule["shape"]
    minor = int(rule["minor"])
    rate_bps = link.rates_bps[k]
    rate = max(8, min(rate_bps, int(uplink_bps) // max(1, rules))) if uplink_bps else rate_bps
    msgs = [nl.htb_class(ifindex, minor, rate, 0, ceil_bps=rate_bps, parent_minor=ACCESS_MINOR)]
    delay, loss = link.netem[k] if link.netem is not None else (old.get("delay_ms") or 0.0,
                                                                old.get("loss_pct") or 0.0)
    if link.netem is not None or any(old.get(f) for f in ("delay_ms", "jitter_ms", "loss_pct")):
        shape = Shape.from_dict({**old, "rate_bps": rate_bps, "delay_ms": delay, "loss_pct": loss})
        msgs.append(nl.netem_leaf(ifindex, minor, shape.delay_ms, shape.jitter_ms, shape.loss_pct,
                                  netem_limit_pkts(shape)))
    return msgs


def _holds(rule: dict[str, Any], link: LinkSchedule, k: int) -> bool:
    """Whether the stored plan's ``rule`` has ``link``'s bin ``k`` already (rate, delay and loss)."""
    shape = rule["shape"]
    rate, netem = link.value(k)
    return shape.get("rate_bps") == rate and (netem is None or
                                              ((shape.get("delay_ms") or 0.0), (shape.get("loss_pct") or 0.0)) == netem)


def due_ticks(k: int, elapsed_s: float, tick_s: float) -> range:
    """The grid ticks due ``elapsed_s`` after the start, from tick ``k`` (the first not yet applied)
    on: one when on time, several when the clock woke late (the last one's bins are applied, the
    others' rows carry the same applied time: their updates were that late)."""
    latest = int(elapsed_s / tick_s + 1e-9)
    return range(k, max(k, latest) + 1)


@contextmanager
def realtime(priority: int = CLOCK_RT_PRIORITY) -> Iterator[str]:
    """Run the calling thread under SCHED_FIFO at ``priority`` for the block (Linux: a policy per
    thread), then as before: on a host whose cores busy processes keep full, a tick that is due
    at nice -10 still waits for a turn; a real-time thread runs as soon as it wakes. Without the
    right to (not root, a container without CAP_SYS_NICE or a real-time budget) it runs at nice
    -10 (``rates.urgent``) instead, said in the log. Yields ``"fifo"`` or ``"nice"``."""
    try:
        old = (os.sched_getscheduler(0), os.sched_getparam(0))
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except (OSError, AttributeError) as e:
        log.info("trace clock: real-time scheduling refused (%s); at nice %d instead", e, URGENT_NICE)
        with urgent():
            yield "nice"
        return
    try:
        yield "fifo"
    finally:
        try:
            os.sched_setscheduler(0, *old)
        except OSError:  # pragma: no cover (giving up real-time is always allowed)
            pass


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
        self._target: list[tuple[int, dict[str, Any], Optional[int], int]] = []  # per link: ifindex, rule, uplink, rules
        self._bins: list[dict[int, list[bytes]]] = []  # per link: its bins' requests, built ahead of their tick
        for link in links:
            if link.src not in nodes:
                raise ConfigError(f"schedule: no node {link.src!r} on this host")
            netns, plan = nodes[link.src]
            rule = next((r for r in plan["rules"] if r["dest"] == link.dst), None)
            if rule is None:
                raise ConfigError(f"schedule: no shaped link {link.src}->{link.dst} on this host")
            _, ifindex = self.sockets.get(netns, plan["ifname"])
            self._where[link.src] = (netns, plan["ifname"])
            self._target.append((ifindex, rule, plan.get("uplink_bps"), len(plan["rules"])))
            self._bins.append({})
        # each link's bin in the kernel (-1: none yet): the first one when the stored plan holds it (deployed at it)
        self.applied: list[int] = [k if _holds(rule, link, k) else -1 for link, (_, rule, _, _), k in
                                   zip(links, self._target, (l.index_at(0.0) for l in links))]
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self.ended: set[tuple[str, str]] = set()  # links a constant rate was set on: no longer ticked
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.policy = ""  # how the thread is scheduled while it ticks: "fifo" or "nice" (``realtime``)
        self.build_ahead(0.0)

    def tick(self, planned_s: float, late_from_s: Optional[float] = None) -> int:
        """Apply the bins of ``planned_s`` that differ from those applied: one batch per node.
        ``late_from_s``: the first of the grid's ticks folded into this one (the clock woke late);
        each gets its row, with the time this batch was accepted."""
        with self._lock:  # an ``end`` waits for a tick under way: no bin lands after the constant rate
            changed = self._tick(planned_s)
            if late_from_s is not None and late_from_s < planned_s:
                self._rows_folded(late_from_s, planned_s)
            return changed

    def _rows_folded(self, first_s: float, planned_s: float) -> None:
        """Rows for the ticks from ``first_s`` to before ``planned_s``: their changes (each
        link's bin against the tick's before) reached the kernel with ``planned_s``'s batch."""
        row = self.rows[-1]
        n = round((planned_s - first_s) / self.tick_s)
        folded = []
        for j in range(n):
            t = first_s + j * self.tick_s
            changes = sum(1 for i, l in enumerate(self.links) if (l.src, l.dst) not in self.ended and
                          (not _holds(self._target[i][1], l, l.index_at(0.0)) if t < self.tick_s / 2
                           else l.value(l.index_at(t)) != l.value(l.index_at(t - self.tick_s))))
            folded.append({**row, "planned_s": round(t, 4), "skew_ms": round((row["applied_s"] - t) * 1000, 2),
                           "changed": changes})
        self.rows[-1:-1] = folded

    def _messages(self, i: int, k: int) -> list[bytes]:
        """Link ``i``'s bin ``k``'s requests (built once: the next tick's are built after a tick)."""
        msgs = self._bins[i].get(k)
        if msgs is None:
            msgs = self._bins[i][k] = bin_messages(self.links[i], k, *self._target[i])
        return msgs

    def build_ahead(self, planned_s: float) -> None:
        """Build the requests of the bins due at ``planned_s`` now, between ticks."""
        with self._lock:
            for i, link in enumerate(self.links):
                if (link.src, link.dst) not in self.ended:
                    try:
                        self._messages(i, link.index_at(planned_s))
                    except (TestbedError, ValueError):  # (said by the tick that sends it)
                        pass

    def _tick(self, planned_s: float) -> int:
        batches: dict[str, list[tuple[int, int]]] = {}
        for i, link in enumerate(self.links):
            if (link.src, link.dst) in self.ended:
                continue
            k = link.index_at(planned_s)
            if k != self.applied[i] and (self.applied[i] < 0 or link.value(k) != link.value(self.applied[i])):
                batches.setdefault(link.src, []).append((i, k))
        outcome = "applied"
        changed = 0
        for src, todo in batches.items():
            try:
                msgs = [m for i, k in todo for m in self._messages(i, k)]
                sock, _ = self.sockets.get(*self._where[src])  # (open: made in __init__)
                failures = sock.run(msgs)
            except OSError as e:
                failures = [nl.Failure(0, e.errno or 0, str(e))]
            except (TestbedError, ValueError) as e:  # a bin's requests could not be built
                failures = [nl.Failure(0, errno.EINVAL, str(e))]
            if failures:
                outcome = f"failed: {src}: {failures[0].describe()}"
                continue
            for i, k in todo:
                self.applied[i] = k
            changed += len(todo)
        applied_s = self.clock() - self.start
        self.rows.append({"planned_s": round(planned_s, 4), "applied_s": round(applied_s, 4),
                          "skew_ms": round((applied_s - planned_s) * 1000, 2),
                          "links": len(self.links) - len(self.ended), "changed": changed, "outcome": outcome})
        if len(self.rows) > KEEP_ROWS:
            del self.rows[:KEEP_ROWS // 2]
        return changed

    def run(self) -> None:
        """Tick until ``stop`` at ``start + k * tick_s`` (an absolute grid: a late tick does not
        shift the next), as a real-time thread (``realtime``); woken late, the latest bins due
        are applied and every tick passed meanwhile is a row of its own (``due_ticks``). Should a
        tick fail past what it handles, the clock stops with a row and a log line that say why
        (the links keep the bins the kernel holds)."""
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - a thread's end is otherwise seen by nobody
            log.exception("trace clock: stopped ticking")
            now_s = round(self.clock() - self.start, 4)
            with self._lock:
                self.rows.append({"planned_s": now_s, "applied_s": now_s, "skew_ms": 0.0,
                                  "links": len(self.links) - len(self.ended), "changed": 0,
                                  "outcome": f"failed: the clock stopped: {type(e).__name__}: {e}"})

    def _run(self) -> None:
        with realtime() as self.policy:
            elapsed_s = self.clock() - self.start  # a start passed a little: its ticks are late, not skipped
            k = 0 if elapsed_s < JOIN_LATE_S else int(elapsed_s / self.tick_s)
            while not self._stop.is_set():
                wait = self.start + k * self.tick_s - self.clock()  # behind: a rest all the same (real time)
                if self._stop.wait(max(wait, MIN_REST_S)):
                    return
                due = due_ticks(k, self.clock() - self.start, self.tick_s)
                self.tick(due[-1] * self.tick_s, late_from_s=due[0] * self.tick_s)
                k = due[-1] + 1
                self.build_ahead(k * self.tick_s)

    def end(self, keys: set[tuple[str, str]]) -> list[tuple[str, str]]:
        """Stop ticking links ``keys`` (a constant rate was set on them); those that were ticked."""
        with self._lock:
            ended = [(l.src, l.dst) for l in self.links if (l.src, l.dst) in keys]
            self.ended.update(ended)
        return ended

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
        return {(l.src, l.dst): k for l, k in zip(self.links, self.applied)
                if k >= 0 and (l.src, l.dst) not in self.ended}

    def rows_since(self, n: int) -> list[dict[str, Any]]:
        with self._lock:
            return self.rows[n:]

    def replan(self, nodes: dict[str, tuple[Optional[str], Optional[dict[str, Any]]]]) -> None:
        """The plans of ``nodes`` (``(netns, plan)``; plan None: not shaped any more) changed:
        their links' requests are built again and re-sent at the next tick; a link no longer
        shaped is no longer ticked."""
        with self._lock:
            self.sockets.close()  # (an interface made again has another index)
            for i, link in enumerate(self.links):
                if link.src not in nodes:
                    continue
                netns, plan = nodes[link.src]
                rule = next((r for r in (plan or {}).get("rules", []) if r["dest"] == link.dst), None)
                if plan is None or rule is None:
                    self.ended.add((link.src, link.dst))
                    continue
                _, ifindex = self.sockets.get(netns, plan["ifname"])
                self._where[link.src] = (netns, plan["ifname"])
                self._target[i] = (ifindex, rule, plan.get("uplink_bps"), len(plan["rules"]))
                self._bins[i] = {}
                self.applied[i] = -1


MAX_LINKS = 10_000
MAX_START_AHEAD_S = 600.0  # a common start further from now than this is refused (a wrong clock)


def _number(value: Any, where: str, lo: float, hi: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not lo <= value <= hi:
        raise ConfigError(f"{where}: {value!r} is not a number from {lo:g} to {hi:g}")
    return float(value)


def parse(body: Any) -> tuple[list[LinkSchedule], float]:
    """``{"version": 1, "start_wall_s": unix seconds, "links": [{"src", "dst", "rates_bps": [...],
    "netem": [[delay_ms, loss_pct], ...] or null, "bin_ms", "loop", "offset_s"}]}``: its links
    (``check``ed) and start; every mistake named by its place before anything runs."""
    where = "schedule"
    if not isinstance(body, dict) or body.get("version") != 1:
        raise ConfigError(f"{where}: not an object of version 1")
    unknown = set(body) - {"version", "start_wall_s", "links"}
    if unknown:
        raise ConfigError(f"{where}: unknown fields {sorted(unknown)}")
    start = _number(body.get("start_wall_s"), f"{where}: start_wall_s", 0)
    if abs(start - time.time()) > MAX_START_AHEAD_S:
        raise ConfigError(f"{where}: start_wall_s is {start - time.time():+.0f} s from this host's clock "
                          f"(more than {MAX_START_AHEAD_S:g} s: are the hosts' clocks synchronised?)")
    items = body.get("links")
    if not isinstance(items, list) or not 0 < len(items) <= MAX_LINKS:
        raise ConfigError(f"{where}: links is not a list of 1 to {MAX_LINKS} links")
    links = []
    for i, item in enumerate(items):
        at = f"{where}: links[{i}]"
        if not isinstance(item, dict):
            raise ConfigError(f"{at}: not an object")
        extra = set(item) - {"src", "dst", "rates_bps", "netem", "bin_ms", "loop", "offset_s"}
        if extra:
            raise ConfigError(f"{at}: unknown fields {sorted(extra)}")
        if not all(isinstance(item.get(f), str) and item.get(f) for f in ("src", "dst")):
            raise ConfigError(f"{at}: src and dst must be node names")
        rates = item.get("rates_bps")
        if not isinstance(rates, list) or len(rates) > MAX_BINS or \
                any(isinstance(r, bool) or not isinstance(r, int) for r in rates):
            raise ConfigError(f"{at}: rates_bps is not a list of integers (at most {MAX_BINS})")
        netem = item.get("netem")
        if netem is not None:
            if not isinstance(netem, list) or any(not isinstance(v, list) or len(v) != 2 for v in netem):
                raise ConfigError(f"{at}: netem is not a list of [delay_ms, loss_pct]")
            netem = tuple((_number(d, f"{at}: netem[{k}] delay_ms", 0, 60_000),
                           _number(l, f"{at}: netem[{k}] loss_pct", 0, 100)) for k, (d, l) in enumerate(netem))
        bin_ms = item.get("bin_ms", 100)
        if isinstance(bin_ms, bool) or not isinstance(bin_ms, int):
            raise ConfigError(f"{at}: bin_ms {bin_ms!r} is not an integer")
        if not isinstance(item.get("loop", False), bool):
            raise ConfigError(f"{at}: loop is not true or false")
        links.append(LinkSchedule(item["src"], item["dst"], tuple(rates), netem, bin_ms, item.get("loop", False),
                                  _number(item.get("offset_s", 0.0), f"{at}: offset_s", 0)))
    check(links)
    return links, start
