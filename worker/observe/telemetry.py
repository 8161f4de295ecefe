"""The telemetry sampler of one worker host: link, node and host counters over time.

Every ``period_s`` (10 ms to 10 s, default 100 ms) one thread reads, for every node of
the testbed on this host:

- each link's HTB class ``1:<minor>`` of the node's interface (the plan maps each
  destination to its minor): bytes, packets, drops, overlimits, backlog bytes;
- the node's interface counters: tx/rx bytes and packets, drops (tx + rx);
- the node's cgroup CPU time and memory (``worker.confinement.cgroups.CounterReader``);

and the host's busy CPU time (``/proc/stat``), used memory (MemTotal - MemAvailable,
``/proc/meminfo``), the tx/rx bytes of its uplink (the interface of its IPv4 default
route) and, on a board with INA3221 power monitors (a Jetson: a physical node), its measured
energy since the sampler started in millijoules (``worker.observe.power_rails.PowerMeter``;
missing elsewhere). One netlink socket per node namespace stays open; each sample sends it one
request buffer (``worker.observe.stats``).

Counters are stored raw, as the kernel gives them, with the host's ``time.monotonic()``;
the reader (the controller) makes them cumulative since the run's start and translates
the time. Samples go to a bounded ring; ``read(cursor)`` returns every sample since the
cursor, so a late reader loses nothing until the ring wraps, and then says how many
samples it lost.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from worker.api.errors import ConfigError
from worker.api.protocol import DEFAULT_PERIOD_MS, MAX_PERIOD_MS, MIN_PERIOD_MS  # noqa: F401 - its names too
from worker.api.protocol import ifname as node_ifname
from worker.confinement.cgroups import Cgroups, CounterReader, process_groups
from worker.kernel import netlink as nl
from worker.kernel import nsfs
from worker.observe.stats import StatsSocket

RING_VALUES = 8_000_000  # counters held at most (8 bytes each): the ring's memory bound
RING_MAX_SECONDS = 120.0  # and never more than this much history
RING_MIN_SAMPLES = 16
LINK_FIELDS = ("tx_bytes", "tx_packets", "drops", "overlimits", "backlog_bytes")
NODE_FIELDS = ("cpu_ns", "mem_bytes", "tx_bytes", "rx_bytes", "tx_packets", "rx_packets", "drops")
HOST_FIELDS = ("cpu_ns", "mem_bytes", "tx_bytes", "rx_bytes", "energy_mj")
MISSING = -1  # a counter that could not be read in this sample
log = logging.getLogger("edgetb.telemetry")


def check_period_ms(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not MIN_PERIOD_MS <= value <= MAX_PERIOD_MS:
        raise ConfigError(f"telemetry period_ms must be an integer from {MIN_PERIOD_MS} to {MAX_PERIOD_MS}, "
                          f"got {value!r}")
    return value


class Ring:
    """A bounded ring of samples addressed by absolute sequence numbers (cursors)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a ring holds one sample at least")
        self.capacity = capacity
        self._items: list[Any] = [None] * capacity
        self._next = 0  # the sequence number the next sample gets
        self._lock = threading.Lock()

    @property
    def next_cursor(self) -> int:
        return self._next

    def append(self, item: Any) -> None:
        with self._lock:
            self._items[self._next % self.capacity] = item
            self._next += 1

    def read(self, cursor: int, limit: Optional[int] = None) -> tuple[list[Any], int, int]:
        """(samples from ``cursor`` on, the cursor to ask with next, how many samples after
        ``cursor`` were overwritten before this read). At most ``limit`` samples."""
        if cursor < 0:
            raise ConfigError(f"cursor must be 0 or more, got {cursor}")
        with self._lock:
            oldest = max(0, self._next - self.capacity)
            cursor = min(cursor, self._next)
            lost = max(0, oldest - cursor)
            start = max(cursor, oldest)
            stop = self._next if limit is None else min(self._next, start + limit)
            items = [self._items[s % self.capacity] for s in range(start, stop)]
        return items, stop, lost


@dataclass
class _Node:
    name: str
    netns: Optional[str]
    ifname: str
    links: list[tuple[str, int]]  # (destination, class handle)
    cgroup: Optional[CounterReader] = None
    sock: Optional[StatsSocket] = None
    slots: dict[int, int] = field(default_factory=dict)  # class handle -> its place in the link values


@dataclass
class Layout:
    """What a sample's flat value arrays hold, in order: links (src, dst) and nodes; and each
    link's configured rate (bit/s) while this layout holds."""

    id: int
    links: list[tuple[str, str]]
    nodes: list[str]
    rates_bps: list[Optional[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"links": [list(k) for k in self.links], "nodes": self.nodes, "rates_bps": self.rates_bps}


def ring_capacity(values_per_sample: int, period_s: float) -> int:
    by_memory = RING_VALUES // max(1, values_per_sample)
    by_time = int(RING_MAX_SECONDS / period_s)
    return max(RING_MIN_SAMPLES, min(by_memory, by_time))


class HostCounters:
    """This host's busy CPU time, used memory, uplink traffic and measured energy (``sysfs_root``:
    where the power monitors are looked for, ``/`` but in tests)."""

    def __init__(self, sysfs_root: str = "/") -> None:
        from worker.observe.power_rails import PowerMeter

        self.power = PowerMeter.find(sysfs_root)
        self.tick_ns = 1_000_000_000 // os.sysconf("SC_CLK_TCK")
        self.uplink = default_route_interface()
        self._fds: list[int] = []
        if self.uplink:
            for name in ("tx_bytes", "rx_bytes"):
                try:
                    self._fds.append(os.open(f"/sys/class/net/{self.uplink}/statistics/{name}", os.O_RDONLY))
                except OSError:
                    self._fds = []
                    break
        self._stat = os.open("/proc/stat", os.O_RDONLY)
        self._meminfo = os.open("/proc/meminfo", os.O_RDONLY)

    def close(self) -> None:
        for fd in [*self._fds, self._stat, self._meminfo]:
            os.close(fd)
        self._fds = []

    def read(self) -> tuple[int, int, int, int, int]:
        line = os.pread(self._stat, 256, 0).split(b"\n", 1)[0].split()
        # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
        ticks = sum(int(x) for x in line[1:9]) - int(line[4]) - int(line[5])
        mem = os.pread(self._meminfo, 512, 0).split(b"\n")
        total = avail = 0
        for entry in mem:
            if entry.startswith(b"MemTotal:"):
                total = int(entry.split()[1]) * 1024
            elif entry.startswith(b"MemAvailable:"):
                avail = int(entry.split()[1]) * 1024
        tx, rx = (int(os.pread(fd, 32, 0)) for fd in self._fds) if self._fds else (MISSING, MISSING)
        energy = self.power.energy_mj(time.monotonic()) if self.power is not None else None
        return ticks * self.tick_ns, total - avail, tx, rx, MISSING if energy is None else energy


def default_route_interface() -> Optional[str]:
    """The interface of the host's IPv4 default route (None without one)."""
    try:
        with open("/proc/net/route") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        pass
    return None


class Sampler:
    """Samples one testbed's nodes and links on this host (see the module's text)."""

    def __init__(self, store: Any, cgroups: Optional[Cgroups], period_ms: int = DEFAULT_PERIOD_MS,
                 host_name: Optional[str] = None, always_dump: bool = False, sysfs_root: str = "/") -> None:
        """``always_dump``: read every class at every sample, even of an idle interface (the
        worst case, for benchmarks); ``sysfs_root``: where power monitors are looked for."""
        self.store = store
        self.cgroups = cgroups
        self.period_ms = check_period_ms(period_ms)
        self.period_s = period_ms / 1000
        self.host_name = host_name or os.uname().nodename
        self.always_dump = always_dump
        self.host = HostCounters(sysfs_root)
        self._nodes: list[_Node] = []
        self._layouts: dict[int, Layout] = {}
        self.layout: Optional[Layout] = None
        self._state_mtime = -1
        self.ring = Ring(RING_MIN_SAMPLES)
        self.cpu_s = 0.0  # CPU time of the sampling thread
        self.samples = 0
        self.late = 0  # periods skipped because a sample took longer than the period
        self.errors = 0
        self.last_error = ""
        self.durations_s: deque[float] = deque(maxlen=1024)  # wall time of the recent samples
        self.started_mono: Optional[float] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # layout ------------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> bool:
        """Re-read which nodes and links exist when the worker's state changed; True if it did."""
        try:
            mtime = os.stat(self.store.path).st_mtime_ns
        except FileNotFoundError:
            mtime = 0
        if mtime == self._state_mtime and not force:
            return False
        self._state_mtime = mtime
        state = self.store.read()
        old = {n.name: n for n in self._nodes}
        nodes: list[_Node] = []
        rates: list[Optional[int]] = []
        for name in sorted(state["nodes"]):
            rec = state["nodes"][name]
            plan = state["plans"].get(name)
            rules = plan["rules"] if plan else []
            links = [(r["dest"], nl.tc_handle(1, int(r["minor"]))) for r in rules]
            rates += [r["shape"].get("rate_bps") for r in rules]
            ifname = node_ifname(rec)
            node = old.pop(name, None)
            if node is None or node.netns != rec.get("netns") or node.ifname != ifname:
                if node is not None:
                    _close_node(node)
                node = _Node(name, rec.get("netns"), ifname, [])
                if self.cgroups is not None and rec.get("runtime", "netns") == "netns":
                    node.cgroup = self.cgroups.reader(name)
                elif rec.get("runtime") == "docker" and rec.get("netns"):
                    node.cgroup = container_reader(rec["netns"])
            if node.links != links or node.sock is None:  # new, or another plan: read anew
                if node.sock is not None:
                    node.sock.close()
                    node.sock = None
                node.links = links
            nodes.append(node)
        for gone in old.values():
            _close_node(gone)
        self._nodes = nodes
        self._link_values = array("q", [MISSING]) * (5 * sum(len(n.links) for n in nodes))
        self._node_values = array("q", [MISSING]) * (len(NODE_FIELDS) * len(nodes))
        at = 0
        for node in nodes:
            node.slots = {}
            for _, handle in node.links:
                node.slots[handle] = at
                at += 5
            if node.sock is not None:  # the values start anew: the next read dumps the classes
                node.sock.close()
                node.sock = None
        layout_id = (self.layout.id + 1) if self.layout else 1
        self.layout = Layout(layout_id, [(n.name, d) for n in nodes for d, _ in n.links], [n.name for n in nodes],
                             rates)
        self._layouts[layout_id] = self.layout
        values = len(self.layout.links) * len(LINK_FIELDS) + len(nodes) * len(NODE_FIELDS)
        capacity = ring_capacity(values, self.period_s)
        if capacity != self.ring.capacity and self.ring.next_cursor == 0:
            self.ring = Ring(capacity)
        return True

    # one sample --------------------------------------------------------------------------------
    def sample(self) -> tuple[float, int, array, array, tuple[int, int, int, int, int]]:
        """Read every counter once: (monotonic time, layout id, link values, node values, host values)."""
        self.refresh()
        assert self.layout is not None
        t = time.monotonic()
        links, values = self._link_values, self._node_values
        at = 0
        for node in self._nodes:
            try:
                if node.sock is None:
                    node.sock = StatsSocket(node.netns, node.ifname, node.slots, self.always_dump)
                interface = node.sock.read(links)
            except OSError as e:  # the namespace or interface went away: try again next time
                interface = None
                self._lost(node, links, e)
            cg = node.cgroup
            cpu = cg.cpu_ns() if cg else None
            mem = cg.mem_bytes() if cg else None
            values[at] = MISSING if cpu is None else cpu
            values[at + 1] = MISSING if mem is None else mem
            if interface is None:
                values[at + 2] = values[at + 3] = values[at + 4] = values[at + 5] = values[at + 6] = MISSING
            else:  # tx bytes, rx bytes, tx packets, rx packets, drops
                values[at + 2], values[at + 3], values[at + 4], values[at + 5], values[at + 6] = interface
            at += 7
        return t, self.layout.id, array("q", links), array("q", values), self.host.read()

    def _lost(self, node: _Node, links: array, error: OSError) -> None:
        """A node's reading failed: its links read as missing, its socket is opened anew next time."""
        for at in node.slots.values():
            links[at:at + 5] = array("q", [MISSING] * 5)
        self.errors += 1
        self.last_error = f"{node.name}: {error}"
        if node.sock is not None:
            node.sock.close()
            node.sock = None

    # the thread --------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the first sample now, then one every period in a thread."""
        if self._thread is not None:
            return
        self.refresh(force=True)
        self.started_mono = time.monotonic()
        self._take()
        self._thread = threading.Thread(target=self._run, name="edgetb-telemetry", daemon=True)
        self._thread.start()

    def _take(self) -> None:
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        try:
            self.ring.append(self.sample())
            self.samples += 1
        except Exception as e:  # noqa: BLE001 - one bad sample must not end the series
            self.errors += 1
            self.last_error = str(e)
            log.exception("telemetry sample failed")
        self.cpu_s += time.thread_time() - cpu0
        self.durations_s.append(time.perf_counter() - wall0)

    def _run(self) -> None:
        due = time.monotonic() + self.period_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            self._take()
            due += self.period_s
            now = time.monotonic()
            if now > due:  # a sample took longer than a period: skip the missed ones
                missed = int((now - due) / self.period_s) + 1
                self.late += missed
                due += missed * self.period_s

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for node in self._nodes:
            _close_node(node)
        self.host.close()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # reads -------------------------------------------------------------------------------------
    def read(self, cursor: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        """Samples since ``cursor`` as a JSON document (layouts named once, values as flat lists)."""
        samples, next_cursor, lost = self.ring.read(cursor, limit)
        used = sorted({s[1] for s in samples})
        return {"host": self.host_name, "now_s": time.monotonic(), "started_s": self.started_mono,
                "period_ms": self.period_ms, "cursor": next_cursor, "lost": lost, "running": self.running,
                "sampler_cpu_s": round(self.cpu_s, 6), "samples_taken": self.samples, "late": self.late,
                "errors": self.errors, "last_error": self.last_error,
                "fields": {"links": list(LINK_FIELDS), "nodes": list(NODE_FIELDS), "host": list(HOST_FIELDS)},
                "layouts": {str(i): self._layouts[i].to_dict() for i in used},
                "samples": [{"t": s[0], "layout": s[1], "links": s[2].tolist(), "nodes": s[3].tolist(),
                             "host": list(s[4])} for s in samples]}


def container_reader(netns: str) -> Optional[CounterReader]:
    """A reader of a container's CPU and memory counters: the groups of a process in its network
    namespace (every process of a container shares its groups); None when it has none."""
    for pid in sorted(nsfs.pids_in(netns)):
        version, dirs = process_groups(pid)
        if version is not None and dirs:
            return CounterReader(version, dirs)
    return None


def _close_node(node: _Node) -> None:
    if node.sock is not None:
        node.sock.close()
        node.sock = None
    if node.cgroup is not None:
        node.cgroup.close()
        node.cgroup = None
