"""Recorded traces replayed by time: one tick per bin sets every traced link's rate at once.

Links join with ``add``: links.json's traced links when the run starts, a scenario's ``trace``
event at its time, a live links file that names a trace when it is applied. Each tick (every
``period_s``, the shortest bin of the links replayed, on a grid from the start) computes every
link's rate at the tick's time (``due``, pure) and sends those that changed in ONE ``set_rates``
request (through a ``Cluster``, one per host; the worker changes them in one netlink batch per
node). A link leaves with ``end``: a constant rate set on it (``/update/tc``, ``/update/link``,
a scenario ``link`` event) ends its trace there; a replay that does not loop holds its last rate.

The ticking thread runs at nice -10 (``TICK_NICE``, as root; the worker's rate changes too): a
loaded host delays a thread of nice 0 by tens of ms. Each tick is a row (``ROW_FIELDS``: planned
and applied seconds since the start, the skew, the links replayed, the rates changed, the
outcome), written as ``trace_ticks.csv`` of the run
folder; ``on_change(rates, t_s)`` tells the run which rates changed when (its ``LinkRates``).
The delay and loss a recording's columns gave a link, when applied, are kept (``netem_over``:
the dashboard's link view) and written as ``trace_netem.csv`` (``NETEM_FIELDS``; empty values:
the trace ended there).

By default (``worker_clock``) ``start`` hands the links traced from the start (not access
links) to their hosts once: each host its links' bins and one common start on the wall clock
(``schedule_start``, ``worker.shaping.schedule``), ticked by the host's own clock; ``end``
tells the host (``schedule_end``); ``stop`` takes the hosts' ticks (``schedule_stop``) into
``rows`` (``trace_ticks.csv``: the applied times the hosts measured). The controller's loop
still tells ``on_change`` (the run's configured rates, the dashboard) each handed link's value
at each bin's planned time, without a request; a host's failed ticks are said at ``stop``. An agent
without the route (or that refuses the schedule) leaves the links to the controller's ticks,
as do links added later (a scenario ``trace`` event, a live links file) and access links.
"""
from __future__ import annotations

import bisect
import csv
import io
import math
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Union

from controller.model.traces import MIN_REPLAY_DELAY_MS, Replay
from controller.results.run_dir import csv_bytes
from worker.api.errors import TestbedError

Key = tuple[str, str]
Value = Union[int, tuple[int, float, float]]  # a rate, or a rate, a delay (ms) and a loss (%)
ROW_FIELDS = ("planned_s", "applied_s", "skew_ms", "links", "changed", "outcome")
TRACE_TICKS_CSV = "trace_ticks.csv"
TRACE_NETEM_CSV = "trace_netem.csv"  # the replayed delay and loss of each link, when they changed
NETEM_FIELDS = ("t_s", "src", "dst", "delay_ms", "loss_pct")
KEEP_NETEM = 200_000  # the delay/loss changes kept (the oldest half dropped beyond)
DEFAULT_PERIOD_S = 0.1
TICK_NICE = -10  # (worker.shaping.rates.URGENT_NICE)
EDGE_S = 1e-6  # a tick on a bin's edge reads the bin that starts there


@dataclass(frozen=True)
class TracedLink:
    """Link ``src -> dst`` replaying ``replay`` from ``start_s`` seconds after the run's start."""

    src: str
    dst: str  # for an access link: "" and ``side``
    replay: Replay
    start_s: float = 0.0
    side: Optional[str] = None  # "uplink" or "downlink": the access link of node ``src``

    @property
    def key(self) -> Key:
        return (self.src, self.dst) if self.side is None else access_key(self.src, self.side)

    def rate_at(self, t_s: float) -> int:
        return self.replay.rate_at(max(0.0, t_s - self.start_s) + EDGE_S)

    def value_at(self, t_s: float) -> Value:
        """Its rate at ``t_s``; with the recording's delay and loss: (rate, delay_ms, loss_pct)."""
        netem = self.replay.netem_at(max(0.0, t_s - self.start_s) + EDGE_S)
        rate = self.rate_at(t_s)
        return rate if netem is None else (rate, *netem)


def rate_of(value: Value) -> int:
    return value if isinstance(value, int) else value[0]


def access_key(node: str, side: str) -> Key:
    """The key of a node's access link among the links' (``@`` is in no node name)."""
    return (node, f"@{side}")


def due(links: Iterable[TracedLink], t_s: float, last: dict[Key, Value]) -> dict[Key, Value]:
    """The values at ``t_s`` (``TracedLink.value_at``) of the links whose value is not ``last``'s."""
    out = {}
    for link in links:
        value = link.value_at(t_s)
        if last.get(link.key) != value:
            out[link.key] = value
    return out


def tick_grid(t_s: float, period_s: float) -> float:
    """The first tick at or after ``t_s`` on the grid of ``period_s`` from 0."""
    return math.ceil(round(t_s / period_s, 6)) * period_s


class TraceReplay:
    """The traced links of one testbed, replayed through ``worker`` (``set_rates``)."""

    def __init__(self, worker: Any, clock: Callable[[], float] = time.monotonic,
                 on_change: Optional[Callable[[dict[Key, int], float], None]] = None,
                 progress: Callable[[str], None] = print, worker_clock: bool = True) -> None:
        self.worker = worker
        self.worker_clock = worker_clock
        self.handed: dict[Key, TracedLink] = {}  # links the hosts' clocks tick
        self.handed_ended: dict[Key, float] = {}  # when a handed link was ended (seconds since the start)
        self.clock = clock
        self.on_change = on_change
        self.progress = progress
        self.links: dict[Key, TracedLink] = {}
        self.last: dict[Key, Value] = {}  # each link's rate (delay, loss) as last applied
        self.rows: list[dict[str, Any]] = []
        # (applied seconds, link, delay ms, loss %) whenever a link's replayed delay/loss changed; None: ended
        self.netem_changes: list[tuple[float, Key, Optional[float], Optional[float]]] = []
        self._netem_now: dict[Key, tuple[float, float]] = {}
        self.t0: Optional[float] = None
        self._cond = threading.Condition()
        self._stopped = False
        self._thread: Optional[threading.Thread] = None
        self._errors: set[str] = set()
        # held while rates are sent: an ``end`` waits for a tick under way, so that no rate of a
        # trace lands after the constant rate that ended it
        self._sending = threading.Lock()

    # the links --------------------------------------------------------------------------------
    @property
    def period_s(self) -> float:
        with self._cond:
            return min((link.replay.tick_s for link in [*self.links.values(), *self._handed_live()]),
                       default=DEFAULT_PERIOD_S)

    def now_s(self) -> float:
        return 0.0 if self.t0 is None else self.clock() - self.t0

    def add(self, links: Iterable[TracedLink], apply_now: bool = False) -> None:
        """Replay ``links`` (a link replaying already is replaced); ``apply_now``: set their
        first rates at once instead of at the next tick."""
        links = list(links)
        with self._sending:
            self._end_handed([link.key for link in links])
        with self._cond:
            for link in links:
                self.links[link.key] = link
                self.last.pop(link.key, None)
            self._cond.notify_all()
        if apply_now and links:  # (a refusal is the caller's error, not a tick's)
            t_s = self.now_s()
            first = due(links, t_s, {})
            try:
                with self._sending:
                    self._send(first)
            except TestbedError:
                self.end(link.key for link in links)  # not replayed: no tick retries them
                raise
            with self._cond:
                self.last.update({k: r for k, r in first.items() if k in self.links})
                self._note_netem(first, t_s)
            if self.on_change is not None:
                self.on_change({k: rate_of(v) for k, v in first.items()}, t_s)

    def end(self, keys: Iterable[Key]) -> list[Key]:
        """Stop replaying on ``keys`` (their rate is set otherwise now); the ones that were replayed."""
        keys = list(keys)
        with self._sending, self._cond:
            handed = self._end_handed(keys)
            ended = [k for k in keys if self.links.pop(k, None) is not None]
            for k in ended:
                self.last.pop(k, None)
                if self._netem_now.pop(k, None) is not None:
                    self.netem_changes.append((self.now_s(), k, None, None))
        return handed + ended

    def _end_handed(self, keys: list[Key]) -> list[Key]:
        """Tell the hosts to stop ticking those of ``keys`` they tick (under ``_sending``)."""
        with self._cond:
            mine = [k for k in keys if k in self.handed and k not in self.handed_ended]
            for k in mine:
                self.handed_ended[k] = self.now_s()
                self.last.pop(k, None)
                if self._netem_now.pop(k, None) is not None:
                    self.netem_changes.append((self.now_s(), k, None, None))
        if mine:
            self.worker.schedule_end({"version": 1, "links": [{"src": s, "dst": d} for s, d in mine]})
        return mine

    def done(self) -> bool:
        """Every link's replay has reached its end (never, for a looped one)."""
        t_s = self.now_s()
        with self._cond:
            links = list(self.links.values()) + [l for k, l in self.handed.items() if k not in self.handed_ended]
            return all(t_s >= link.start_s + link.replay.end_s for link in links)

    # the clock --------------------------------------------------------------------------------
    def start(self, t0: Optional[float] = None) -> None:
        """Tick from ``t0`` (the monotonic time of the run's start; default now) until ``stop``."""
        self.t0 = self.clock() if t0 is None else t0
        if self.worker_clock:
            self._hand_over()
        self._thread = threading.Thread(target=self._loop, name="edgetb-trace-replay", daemon=True)
        self._thread.start()

    def _hand_over(self) -> None:
        """The links traced from the start, to their hosts' clocks (else they stay the controller's)."""
        with self._cond:
            links = [l for l in self.links.values() if l.side is None and l.start_s == 0 and schedulable(l.replay)]
        if not links or not hasattr(self.worker, "schedule_start"):
            return
        start_wall_s = time.time() + (self.t0 - self.clock())
        body = {"version": 1, "start_wall_s": round(start_wall_s, 6), "links": [schedule_of(l) for l in links]}
        try:
            self.worker.schedule_start(body)
        except TestbedError as e:
            self.progress(f"trace replay: the hosts' clocks refused the schedule ({e.message}); "
                          "the controller ticks it")
            return
        with self._cond:
            for link in links:
                self.links.pop(link.key, None)
                self.handed[link.key] = link

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.handed:
            self._take_back()

    def _take_back(self) -> None:
        """Stop the hosts' clocks; their ticks into ``rows``, the rates they set to ``on_change``."""
        try:
            answer = self.worker.schedule_stop()
        except TestbedError as e:
            self.progress(f"trace replay: stopping the hosts' clocks failed: {e.message}")
            return
        if answer.get("stopped_hosts") or not answer.get("running", True):
            self.progress("trace replay: a host had no clock running at the end (its agent restarted?): "
                          f"{', '.join(answer.get('stopped_hosts') or ['the host'])}; its ticks are not recorded")
        rows = sorted(({f: r[f] for f in ROW_FIELDS} for r in answer.get("rows", [])),
                      key=lambda r: r["planned_s"])
        failed = [r for r in rows if r["outcome"] != "applied"]
        if failed:
            self.progress(f"trace replay: {len(failed)} of the hosts' ticks failed, the first at "
                          f"{failed[0]['planned_s']:.1f}s: {failed[0]['outcome']}")
        self.rows = sorted(self.rows + rows, key=lambda r: r["planned_s"])

    def _loop(self) -> None:
        try:  # this thread's own (Linux: per thread); as root: on a loaded host a tick waits behind busy processes
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TICK_NICE)
        except OSError:
            pass
        next_s = 0.0
        while True:
            with self._cond:
                while not self._stopped and not self.links and not self._handed_live():
                    self._cond.wait()
                period = self.period_s
                if self.now_s() - next_s > period:  # behind (a slow tick, links added late): the next on the grid
                    next_s = tick_grid(self.now_s(), period)
                while not self._stopped and self.now_s() < next_s:
                    self._cond.wait(timeout=next_s - self.now_s())
                if self._stopped:
                    return
            self.tick(next_s)
            next_s = round((next_s + period) / period) * period

    def tick(self, planned_s: float) -> dict[Key, Value]:
        """Apply the rates (delays, losses) of time ``planned_s``: those that changed, in one request; a row.
        The links the hosts' clocks tick: their values of that time told ``on_change`` (no request)."""
        with self._sending:
            with self._cond:
                links = list(self.links.values())
                changed = due(links, planned_s, self.last)
                theirs = due(self._handed_live(), planned_s, self.last)
                self.last.update(theirs)
                self._note_netem(theirs, planned_s, among=self.handed)
            if theirs and self.on_change is not None:
                self.on_change({k: rate_of(v) for k, v in theirs.items()}, planned_s)
            if not links:
                return theirs
            return self._apply(changed, planned_s, len(links))

    def _handed_live(self) -> list[TracedLink]:
        """The links the hosts' clocks tick, not ended (under ``_cond``)."""
        return [l for k, l in self.handed.items() if k not in self.handed_ended]

    def _apply(self, changed: dict[Key, Value], planned_s: float, links: int) -> dict[Key, Value]:
        outcome = "applied"
        if changed:
            try:
                self._send(changed)
                with self._cond:
                    for key, value in changed.items():
                        if key in self.links:
                            self.last[key] = value
                    self._note_netem(changed, self.now_s())
            except TestbedError as e:
                outcome = f"failed: {e.message}"
                if e.message not in self._errors:  # each problem said once, every tick recorded
                    self._errors.add(e.message)
                    self.progress(f"trace replay at {planned_s:.1f}s: {e.message}")
        applied_s = self.now_s()
        self.rows.append({"planned_s": round(planned_s, 4), "applied_s": round(applied_s, 4),
                          "skew_ms": round((applied_s - planned_s) * 1000, 2), "links": links,
                          "changed": len(changed), "outcome": outcome})
        if changed and outcome == "applied" and self.on_change is not None:
            self.on_change({k: rate_of(v) for k, v in changed.items()}, applied_s)
        return changed

    def _send(self, changed: dict[Key, Value]) -> None:
        """Links' rates in one ``set_rates`` request; access links' in one merging links update
        (their classes are shares of the access rate: the worker re-plans those nodes)."""
        rates = [{"src": s, "dst": d, "rate_bps": v} if isinstance(v, int) else
                 {"src": s, "dst": d, "rate_bps": v[0], "delay_ms": v[1], "loss_pct": v[2]}
                 for (s, d), v in changed.items() if not d.startswith("@")]
        access: dict[str, dict[str, int]] = {}
        for (node, d), r in changed.items():
            if d.startswith("@"):
                access.setdefault(node, {})[f"{d[1:]}_bps"] = r
        if rates:
            self.worker.set_rates({"version": 1, "rates": rates})
        if access:
            self.worker.set_links({"version": 1, "links": [], "access": access}, merge=True)

    def _note_netem(self, applied: dict[Key, Value], t_s: float, among: Optional[dict[Key, Any]] = None) -> None:
        """Keep the delays and losses among ``applied`` (at ``t_s``) that changed (under ``_cond``)."""
        among = self.links if among is None else among
        for key, value in applied.items():
            if isinstance(value, int) or key not in among or self._netem_now.get(key) == value[1:]:
                continue
            self._netem_now[key] = (value[1], value[2])
            self.netem_changes.append((round(t_s, 4), key, value[1], value[2]))
        if len(self.netem_changes) > KEEP_NETEM:
            del self.netem_changes[:KEEP_NETEM // 2]

    def netem_over(self, key: Key, times: Iterable[float]) -> Optional[dict[str, list[Optional[float]]]]:
        """The delay (ms) and loss (%) replayed on ``key`` at each of ``times`` (None where no
        recording's were); None when the link never replayed any."""
        with self._cond:
            mine = [(t, d, l) for t, k, d, l in self.netem_changes if k == key]
        return netem_at_times(mine, times)

    # results ------------------------------------------------------------------------------------
    def csv_text(self) -> str:
        return csv_bytes(list(ROW_FIELDS), self.rows).decode()

    def netem_csv_text(self) -> str:
        with self._cond:
            rows = [{"t_s": t, "src": k[0], "dst": k[1], "delay_ms": "" if d is None else d,
                     "loss_pct": "" if l is None else l} for t, k, d, l in self.netem_changes]
        return csv_bytes(list(NETEM_FIELDS), rows).decode()

    def write(self, out: Any) -> None:
        """``trace_ticks.csv`` into the run folder (when anything was replayed); ``trace_netem.csv``
        when a recording's delay and loss were."""
        if self.rows:
            out.write_bytes(TRACE_TICKS_CSV, self.csv_text().encode())
        if self.netem_changes:
            out.write_bytes(TRACE_NETEM_CSV, self.netem_csv_text().encode())


def netem_at_times(changes: list[tuple[float, Optional[float], Optional[float]]],
                   times: Iterable[float]) -> Optional[dict[str, list[Optional[float]]]]:
    """``{"delay_ms": [...], "loss_pct": [...]}`` at each of ``times`` from one link's changes
    (applied seconds, delay, loss; in time order): the last change at or before each time."""
    if not changes:
        return None
    out: dict[str, list[Optional[float]]] = {"delay_ms": [], "loss_pct": []}
    stamps = [c[0] for c in changes]
    for t in times:
        i = bisect.bisect_right(stamps, t + 1e-9) - 1
        delay, loss = (changes[i][1], changes[i][2]) if i >= 0 else (None, None)
        out["delay_ms"].append(delay)
        out["loss_pct"].append(loss)
    return out


def stored_netem(text: str, key: Key, times: Iterable[float]) -> Optional[dict[str, list[Optional[float]]]]:
    """``netem_at_times`` of link ``key`` from a stored ``trace_netem.csv``'s text."""
    changes = []
    for row in csv.DictReader(io.StringIO(text)):
        if (row["src"], row["dst"]) == key:
            changes.append((float(row["t_s"]), float(row["delay_ms"]) if row["delay_ms"] else None,
                            float(row["loss_pct"]) if row["loss_pct"] else None))
    changes.sort(key=lambda c: c[0])
    return netem_at_times(changes, times)


def schedulable(replay: Replay) -> bool:
    """A replay the hosts' clocks can tick: bins of a whole number of ms (time scale included)."""
    bin_ms = replay.tick_s * 1000
    return abs(bin_ms - round(bin_ms)) < 1e-6 and round(bin_ms) >= 10


def schedule_of(link: TracedLink) -> dict[str, Any]:
    """``link``'s entry of a host's schedule (``worker.shaping.schedule.parse``): the bins the
    controller's ticks would apply (``Replay.rate_at``/``netem_at`` of each bin)."""
    replay, trace = link.replay, link.replay.trace
    rates = [replay.replayed(r) for r in trace.rates_bps]
    netem = None
    if replay.needs_netem:
        n = len(rates)
        delays = trace.delays_ms if trace.delays_ms is not None else [0.0] * n
        losses = trace.losses_pct if trace.losses_pct is not None else [0.0] * n
        netem = [[max(float(d), MIN_REPLAY_DELAY_MS), float(l)] for d, l in zip(delays, losses)]
    return {"src": link.src, "dst": link.dst, "rates_bps": rates, "netem": netem,
            "bin_ms": round(replay.tick_s * 1000), "loop": replay.loop,
            "offset_s": replay.offset_s * replay.time_scale}


def traced_links(topology: Any) -> list[TracedLink]:
    """The links and access links of ``topology`` (a ``Topology``) that replay a recording."""
    return ([TracedLink(src, dst, replay) for (src, dst), replay in topology.traces.items()]
            + [TracedLink(node, "", replay, side=side) for (node, side), replay in topology.access_traces.items()])


STOP_AFTER_FAILED_TICKS = 20  # a testbed taken down under the replay: every tick that sends rates fails
KEEP_ROWS = 100_000  # the ticks a foreground replay keeps (about 3 hours of 100 ms bins)


def replay_in_foreground(worker: Any, links: list[TracedLink], seconds: Optional[float] = None,
                         progress: Callable[[str], None] = print, sleep_s: float = 0.2) -> TraceReplay:
    """Replay ``links`` from now on a testbed that is up (``edgetb up``) until ``seconds`` pass,
    every replay reached its end (none looped), ``STOP_AFTER_FAILED_TICKS`` ticks in a row
    failed (the nodes went away) or Ctrl-C / SIGTERM (a ``KeyboardInterrupt``, taken here as the
    end); the links keep their last rates. Returns the replay (its ``rows``: the ticks)."""
    # the controller's ticks: their failures stop it (a testbed taken down), which a host's clock tells only at its end
    replay = TraceReplay(worker, progress=progress, worker_clock=False)
    replay.add(links)
    replay.start()
    deadline = math.inf if seconds is None else replay.clock() + seconds
    why = "the time given"
    try:
        while replay.clock() < deadline:
            if replay.done():
                why = "every recording replayed to its end"
                break
            if (outcome := _failing(replay.rows, STOP_AFTER_FAILED_TICKS)) is not None:
                why = f"{STOP_AFTER_FAILED_TICKS} ticks in a row failed ({outcome})"
                break
            if len(replay.rows) > KEEP_ROWS:  # (a replay of days: the summary is of the last ticks)
                del replay.rows[:KEEP_ROWS // 2]
            time.sleep(min(sleep_s, max(0.0, deadline - replay.clock())))
    except KeyboardInterrupt:
        why = "interrupted"
    finally:
        replay.stop()
    progress(f"trace replay stopped ({why}) after {replay.now_s():.1f} s: {tick_summary(replay.rows)}; "
             "the links keep their last rates")
    return replay


def _failing(rows: list[dict[str, Any]], n: int) -> Optional[str]:
    """The last outcome when the last ``n`` ticks that sent rates all failed, else None."""
    for row in reversed(rows):
        if row["changed"]:
            if row["outcome"] == "applied":
                return None
            n -= 1
            if n == 0:
                return next(r["outcome"] for r in reversed(rows) if r["changed"])
    return None


def tick_summary(rows: list[dict[str, Any]]) -> str:
    """Ticks, rates changed, failures and the median skew, for people."""
    if not rows:
        return "no tick"
    skews = sorted(r["skew_ms"] for r in rows)
    failed = sum(r["outcome"] != "applied" for r in rows)
    return (f"{len(rows)} ticks, {sum(r['changed'] for r in rows)} rates changed, median skew "
            f"{skews[len(skews) // 2]:g} ms" + (f", {failed} failed" if failed else ""))
