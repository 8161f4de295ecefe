"""Faults a scenario applies to running nodes: packet drops, signals, freezing, limits, flows.

- **Drops** (loss, link down, partitions): iptables rules in the RECEIVING node's namespace,
  ``INPUT -s <sender> [-m statistic --mode random --probability p] -j DROP``, each with the
  comment ``edgetb-<id>-scn-<key>`` so that undoing an event removes exactly its rules and a
  reset finds every one. On the receiving side a drop is a packet lost on the wire: a drop in
  the sender's OUTPUT chain is reported to the sender instead (UDP's ``sendto`` fails with
  EPERM, TCP keeps the segment queued and never sees a loss). Interfaces and tc shaping are
  never touched: when the rules go, the shaping is what it was (it was never changed). One
  ``iptables-restore --noflush`` per node and change.
- **Signals**: a crash is SIGKILL of every process in the node's namespace; a revocation
  SIGTERM, then SIGKILL after ``notice_s`` (a timer, the call returns at once).
- **Pause/resume**: the node's processes moved into a freezer group (cgroup v1
  ``freezer/edgetb-<id>/<node>``) and frozen; on v2, ``cgroup.freeze`` of the node's own
  group, so its limits and counters stay with it.
- **Limits**: CPU and memory changed in the node's cgroups (made when the node had none).
- **Prepare**: a pause or a limits change made ready ahead of its time: the groups made and the
  node's processes moved in. Moving a process between cgroups waits for an RCU grace period
  (about 15 ms here) when no move came shortly before; prepared, the event itself is one write.
  Processes already in a group are never written again (the write alone pays that wait).
- **Background flows**: iperf3 server and client in the nodes, constant or ON/OFF (a client
  per ON period), each interval recorded from iperf3's JSON.

The requests are ``worker.api.faults``'s classes, one per kind; ``Faults`` applies each by a
table of kind -> method. ``drop_lines`` is pure; ``Faults`` does the rest for one ``WorkerHost``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from worker.api.errors import CapabilityError, NodeRuntimeError, NotFound
from worker.api.faults import (Background, BackgroundResult, Clear, Drop, FaultKind, Freeze,
                               IperfServer, Kill, Limits, Prepare, Restart, Terminate, Thaw, Undrop, parse_faults)
from worker.api.schema import ABSENT
from worker.confinement import cgroups
from worker.kernel import nsfs
from worker.nodes.runtime import Runtime

FREEZER_V1 = "/sys/fs/cgroup/freezer"
CGROUP2_ROOTS = ("/sys/fs/cgroup/unified", "/sys/fs/cgroup")
IPERF_INTERVAL_S = 0.2
PARALLEL_NODES = 8


def comment(testbed_id: str, key: str = "") -> str:
    return f"edgetb-{testbed_id}-scn-{key}" if key else f"edgetb-{testbed_id}-scn-"


def drop_lines(testbed_id: str, key: str, src_ips: list[str], percent: float) -> list[str]:
    """iptables-restore lines adding the drops of one event in a receiving node (``percent`` of
    the packets from each sender; 100 drops all)."""
    lines = ["*filter"]
    for ip in src_ips:
        rule = f"-A INPUT -s {ip}/32 -m comment --comment {comment(testbed_id, key)}"
        if percent < 100:
            rule += f" -m statistic --mode random --probability {percent / 100:.6f}"
        lines.append(rule + " -j DROP")
    return lines + ["COMMIT", ""]


def delete_lines(saved: str, testbed_id: str, key: str = "") -> list[str]:
    """iptables-restore lines deleting the rules of ``iptables-save`` output that carry the
    comment of ``key`` (every scenario rule of the testbed without a key)."""
    out = ["*filter"]
    for line in saved.splitlines():
        words = [w.strip('"') for w in line.split()]
        if words[:1] == ["-A"] and any(w == comment(testbed_id, key) if key else w.startswith(comment(testbed_id))
                                       for w in words):
            out.append("-D " + " ".join(words[1:]))
    return out + ["COMMIT", ""] if len(out) > 1 else []


def iperf_client_argv(dst_ip: str, port: int, rate_bps: int, seconds: float, protocol: str) -> list[str]:
    argv = ["iperf3", "-c", dst_ip, "-p", str(port), "-J", "-i", str(IPERF_INTERVAL_S), "-b", str(rate_bps),
            "-t", f"{max(1, round(seconds))}"]
    return argv + (["-u"] if protocol == "udp" else [])


def flow_samples(report: dict[str, Any], offset_s: float) -> list[dict[str, Any]]:
    """iperf3 JSON intervals as samples: start_s (since the flow began), seconds, bytes, bps."""
    out = []
    for interval in report.get("intervals", []):
        s = interval.get("sum", {})
        out.append({"start_s": round(offset_s + float(s.get("start", 0)), 4), "seconds": float(s.get("seconds", 0)),
                    "bytes": int(s.get("bytes", 0)), "bps": float(s.get("bits_per_second", 0))})
    return out


class Faults:
    """The scenario's changes on one worker host; ``host`` is its ``WorkerHost``."""

    def __init__(self, host: Any) -> None:
        self.host = host
        self.id = host.testbed_id
        self._timers: list[threading.Timer] = []
        self._flows: dict[str, dict[str, Any]] = {}
        self._keys: dict[tuple[str, str], list[str]] = {}  # the drop lines this worker added, by (node, key)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.handlers: dict[FaultKind, Callable[[Any], dict[str, Any]]] = {
            "drop": self._drop,
            "undrop": self._undrop,
            "kill": self._kill,
            "terminate": self._terminate,
            "freeze": self._freeze,
            "thaw": self._thaw,
            "limits": self._limits,
            "restart": self._restart,
            "iperf_server": self._iperf_server,
            "background": self._background,
            "background_result": self._background_result,
            "clear": self._clear,
            "prepare": self._prepare,
        }

    @property
    def runtime(self) -> Runtime:
        """The host's node runtime: its ``cgroups`` hold a netns node's limits and counters (None
        on docker and physical hosts)."""
        return self.host.runtime

    # dispatch -----------------------------------------------------------------------------
    def apply(self, faults: Any) -> list[dict[str, Any]]:
        """The request's ``faults`` list, every one checked (``worker.api.faults``) and every node
        known before anything changes; then applied in order within a node, nodes in parallel."""
        checked = parse_faults(faults)
        for f in checked:
            self._netns(f.node)
        by_node: dict[str, list[int]] = {}
        for i, f in enumerate(checked):
            by_node.setdefault(f.node, []).append(i)
        results: list[Any] = [None] * len(checked)

        def node_faults(indices: list[int]) -> None:
            for i in indices:
                results[i] = self.handlers[checked[i].kind](checked[i])

        if len(by_node) == 1:
            node_faults(next(iter(by_node.values())))
        else:
            with ThreadPoolExecutor(max_workers=min(PARALLEL_NODES, len(by_node))) as pool:
                for future in [pool.submit(node_faults, idx) for idx in by_node.values()]:
                    future.result()
        return results

    def _netns(self, node: str) -> str:
        rec = self.host.store.snapshot()["nodes"].get(node)
        if rec is None:
            rec = self.runtime.node(node)  # its NotFound names the node and the testbed
        if not rec.get("netns"):
            raise CapabilityError(f"node {node}: scenario faults need an emulated node (netns or docker: a network "
                                  "namespace of its own); a physical device is not changed")
        return rec["netns"]

    def _in_netns(self, node: str, argv: list[str], stdin: str = "") -> str:
        fd = os.open(nsfs.netns_path(self._netns(node)), os.O_RDONLY | os.O_CLOEXEC)
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=30,
                                  preexec_fn=lambda: nsfs.setns_fd(fd))
        finally:
            os.close(fd)
        if done.returncode != 0:
            raise NodeRuntimeError(f"node {node}: {argv[0]} failed: {done.stderr.strip()[:300]}")
        return done.stdout

    # drops ----------------------------------------------------------------------------------
    def _drop(self, f: Drop) -> dict[str, Any]:
        if (f.node, f.key) in self._keys:
            self._remove_drops(f.node, f.key)  # the same key again replaces its rules
        if f.percent > 0:
            lines = drop_lines(self.id, f.key, f.src_ips, f.percent)
            self._in_netns(f.node, ["iptables-restore", "-w", "--noflush"], "\n".join(lines))
            self._keys[(f.node, f.key)] = lines
        return {"node": f.node, "kind": "drop", "rules": len(f.src_ips) if f.percent > 0 else 0}

    def _undrop(self, f: Undrop) -> dict[str, Any]:
        return {"node": f.node, "kind": "undrop", "removed": self._remove_drops(f.node, f.key)}

    def _remove_drops(self, node: str, key: str = "") -> int:
        """Remove the node's drops of ``key`` (every scenario drop of the node without one); how many."""
        added = self._keys.pop((node, key), None) if key else None
        if added is not None:  # made by this worker: its own lines, deleted (one process, no listing)
            lines = [("-D" + line[2:]) if line.startswith("-A ") else line for line in added]
        else:  # another process made them, or every rule of the node: as the kernel lists them
            saved = self._in_netns(node, ["iptables-save", "-t", "filter"])
            lines = delete_lines(saved, self.id, key)
            self._keys = {k: v for k, v in self._keys.items() if k[0] != node}
        if lines:
            self._in_netns(node, ["iptables-restore", "-w", "--noflush"], "\n".join(lines))
        return len(lines) - 3 if lines else 0

    def rules(self, node: str) -> list[str]:
        """The node's scenario rules as iptables-save lists them."""
        saved = self._in_netns(node, ["iptables-save", "-t", "filter"])
        return [line for line in saved.splitlines() if comment(self.id) in line]

    # signals ----------------------------------------------------------------------------------
    def _pids(self, node: str) -> list[int]:
        return [p for p in nsfs.pids_in(self._netns(node)) if p != os.getpid()]

    def _signal(self, node: str, sig: int, pids: Optional[list[int]] = None) -> list[int]:
        """Send ``sig`` to the node's processes (``pids``: those found already); the pids signalled."""
        pids = self._pids(node) if pids is None else pids
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def _kill(self, f: Kill) -> dict[str, Any]:
        killed = self._signal(f.node, signal.SIGKILL)
        self._thaw_node(f.node)  # a frozen process dies only once thawed
        return {"node": f.node, "kind": "kill", "processes": len(killed)}

    def _terminate(self, f: Terminate) -> dict[str, Any]:
        node = f.node
        self._thaw_node(node)
        pids = self._signal(node, signal.SIGTERM)
        if f.notice_s <= 0:
            self._signal(node, signal.SIGKILL, pids)
        else:
            timer = threading.Timer(f.notice_s, lambda: self._signal(node, signal.SIGKILL))
            timer.daemon = True
            with self._lock:
                self._timers.append(timer)
            timer.start()
        return {"node": node, "kind": "terminate", "processes": len(pids), "kill_after_s": f.notice_s}

    def _restart(self, f: Restart) -> dict[str, Any]:
        started = self.host.restart_processes(f.node)
        return {"node": f.node, "kind": "restart", "started": started}

    # freezer -----------------------------------------------------------------------------------
    def freezer_base(self) -> tuple[str, int]:
        """The testbed's freezer group (its nodes' groups beneath) and the cgroup version."""
        if os.path.isdir(FREEZER_V1):
            return os.path.join(FREEZER_V1, f"edgetb-{self.id}"), 1
        for root in CGROUP2_ROOTS:
            if os.path.exists(os.path.join(root, "cgroup.controllers")):
                return os.path.join(root, f"edgetb-{self.id}-freeze"), 2
        raise CapabilityError("no cgroup freezer (v1 freezer or a v2 hierarchy): pause cannot be applied")

    def freezer_dir(self, node: str) -> tuple[str, int]:
        """Where the node is frozen. On v2 a process is in one group only, so the node's own group
        (its limits and counters: every netns node has one) is frozen where the runtime keeps
        one: a group of its own would take the node out of its limits."""
        base, version = self.freezer_base()
        own = self._own_v2_group(node) if version == 2 else None
        return own or os.path.join(base, node), version

    def _own_v2_group(self, node: str) -> Optional[str]:
        groups: Optional[cgroups.Cgroups] = self.runtime.cgroups
        if groups is None or groups.version != 2:
            return None
        path = groups.dirs(node)[0]
        return path if os.path.isdir(path) else None

    def _freeze(self, f: Freeze) -> dict[str, Any]:
        path, version = self.freezer_dir(f.node)
        os.makedirs(path, exist_ok=True)
        pids = self._pids(f.node)
        _join(os.path.join(path, "cgroup.procs"), pids)
        state_file, value = ("freezer.state", "FROZEN") if version == 1 else ("cgroup.freeze", "1")
        with open(os.path.join(path, state_file), "w") as fh:
            fh.write(value)
        return {"node": f.node, "kind": "freeze", "processes": len(pids)}

    def _thaw(self, f: Thaw) -> dict[str, Any]:
        thawed = self._thaw_node(f.node)
        return {"node": f.node, "kind": "thaw"} if thawed else {"node": f.node, "kind": "thaw", "processes": 0}

    def _thaw_node(self, node: str) -> bool:
        """Thaw the node's freezer group; False when it has none."""
        path, version = self.freezer_dir(node)
        if not os.path.isdir(path):
            return False
        state_file, value = ("freezer.state", "THAWED") if version == 1 else ("cgroup.freeze", "0")
        with open(os.path.join(path, state_file), "w") as fh:
            fh.write(value)
        return True

    def frozen(self, node: str) -> bool:
        path, version = self.freezer_dir(node)
        try:
            with open(os.path.join(path, "freezer.state" if version == 1 else "cgroup.freeze")) as fh:
                return fh.read().strip() in ("FROZEN", "FREEZING", "1")
        except FileNotFoundError:
            return False

    def _remove_freezers(self) -> None:
        base, version = self.freezer_base()
        groups: Optional[cgroups.Cgroups] = self.runtime.cgroups
        if version == 2 and groups is not None and groups.version == 2:
            for node in groups.nodes():  # frozen in their own groups: thawed, removed by the runtime
                _write_quiet(groups.dirs(node)[0], 2)
        if not os.path.isdir(base):
            return
        groups = self.runtime.cgroups
        for node in os.listdir(base):
            path = os.path.join(base, node)
            if os.path.isdir(path):
                _write_quiet(path, version)
                if groups is not None and groups.freezer_dir(node) == path:
                    continue  # the node's own group (v1): its processes stay for the runtime's reset to kill
                _empty_into(path, os.path.dirname(base))
                for _ in range(100):
                    try:
                        os.rmdir(path)
                        break
                    except OSError:
                        time.sleep(0.02)
        try:
            os.rmdir(base)
        except OSError:
            pass

    # limits -----------------------------------------------------------------------------------
    def _limits(self, f: Limits) -> dict[str, Any]:
        node = f.node
        with self.host.store.locked() as state:
            rec = state["nodes"][node]
            cpu = rec.get("cpu") if f.cpu is ABSENT else f.cpu
            mem = rec.get("mem_bytes") if f.mem_bytes is ABSENT else f.mem_bytes
            groups = self.runtime.cgroups  # netns: docker and physical nodes have none
            groups.set_limits(node, cpu, mem, rec.get("pids_max"))  # (memory None: the default limit)
            pids = self._pids(node)
            for procs in groups.procs_files(node):
                _join(procs, pids)
            rec["cpu"], rec["mem_bytes"] = cpu, mem
        return {"node": node, "kind": "limits", "cpu": cpu, "mem_bytes": mem}

    def _prepare(self, f: Prepare) -> dict[str, Any]:
        """The groups of a coming pause or limits change made, the node's processes moved in."""
        node = f.node
        pids = self._pids(node)
        if f.for_ == "freeze":
            path, _ = self.freezer_dir(node)
            os.makedirs(path, exist_ok=True)
            files = [os.path.join(path, "cgroup.procs")]
        else:
            groups = self.runtime.cgroups  # netns: docker and physical nodes have none
            groups.require()
            if not all(os.path.isdir(d) for d in groups.dirs(node)):
                rec = self.host.store.snapshot()["nodes"][node]  # made with the limits it has now
                groups.create(node, rec.get("cpu"), rec.get("mem_bytes"), rec.get("pids_max"))
            files = groups.procs_files(node)
        moved = sum(_join(procs, pids) for procs in files)
        return {"node": node, "kind": "prepare", "for": f.for_, "moved": moved}

    # background flows --------------------------------------------------------------------------
    def _iperf_server(self, f: IperfServer) -> dict[str, Any]:
        proc = self.host.start_process(f.node, {"version": 1, "argv": ["iperf3", "-s", "-p", str(f.port)]})
        with self._lock:
            self._flows.setdefault(f.key, {"samples": [], "runs": [], "done": False})["server"] = (f.node, proc["id"])
        return {"node": f.node, "kind": "iperf_server", "process": proc["id"]}

    def _background(self, f: Background) -> dict[str, Any]:
        with self._lock:
            flow = self._flows.setdefault(f.key, {"samples": [], "runs": [], "done": False})
        thread = threading.Thread(target=self._run_flow, args=(f, flow, self._stop), daemon=True,
                                  name=f"flow-{f.key}")
        thread.start()
        return {"node": f.node, "kind": "background", "key": f.key}

    def _run_flow(self, f: Background, flow: dict[str, Any], stop: threading.Event) -> None:
        started = time.monotonic()
        end = started + f.duration_s
        on_s = f.on_s or f.duration_s
        try:
            time.sleep(0.2)  # the server listens
            while not stop.is_set():
                begin = time.monotonic()
                seconds = min(on_s, end - begin)
                if seconds < 0.5:
                    break
                argv = iperf_client_argv(f.dst_ip, f.port, f.rate_bps, seconds, f.protocol)
                child = self.host.popen(f.node, argv, {}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE)
                out, err = child.communicate(timeout=seconds + 30)
                try:
                    report = json.loads(out)
                except ValueError:
                    report = {"error": (err or out)[:300].decode(errors="replace")}
                flow["runs"].append({"start_s": round(begin - started, 4), "error": report.get("error")})
                flow["samples"] += flow_samples(report, begin - started)
                if not f.off_s:
                    break
                rest = begin + on_s + f.off_s - time.monotonic()
                if rest > 0 and stop.wait(rest):
                    break
                if time.monotonic() >= end:
                    break
        finally:
            flow["done"] = True
            server = flow.get("server")
            if server:
                try:
                    self.host.stop_process(*server)
                except NotFound:
                    pass

    def _background_result(self, f: BackgroundResult) -> dict[str, Any]:
        flow = self._flows.get(f.key)
        if flow is None:
            raise NotFound(f"no background flow {f.key!r}")
        return {"node": f.node, "kind": "background_result", "key": f.key, "done": flow["done"],
                "runs": list(flow["runs"]), "samples": list(flow["samples"])}

    # cleanup --------------------------------------------------------------------------------------
    def _clear(self, f: Clear) -> dict[str, Any]:
        self._remove_drops(f.node)
        self._thaw_node(f.node)
        return {"node": f.node, "kind": "clear"}

    def reset(self) -> None:
        """Stop flows and timers, thaw and remove the freezer groups (rules go with the namespaces)."""
        self._stop.set()
        with self._lock:
            for timer in self._timers:
                timer.cancel()
            self._timers.clear()
            self._stop = threading.Event()  # for the next testbed this worker makes
            self._flows.clear()
            self._keys.clear()
        try:
            self._remove_freezers()
        except CapabilityError:
            pass

    def leftovers(self) -> list[str]:
        try:
            base = self.freezer_base()[0]
        except CapabilityError:
            return []
        return [base] if os.path.isdir(base) else []


def _join(procs_file: str, pids: list[int]) -> int:
    """Move into a group those of ``pids`` not in it yet (gone ones skipped); how many moved."""
    try:
        with open(procs_file) as fh:
            members = {int(line) for line in fh.read().split()}
    except OSError:
        members = set()
    moved = 0
    for pid in pids:
        if pid in members:
            continue
        try:
            with open(procs_file, "w") as fh:
                fh.write(str(pid))
            moved += 1
        except OSError:
            pass  # gone meanwhile
    return moved


def _write_quiet(path: str, version: int) -> None:
    try:
        with open(os.path.join(path, "freezer.state" if version == 1 else "cgroup.freeze"), "w") as fh:
            fh.write("THAWED" if version == 1 else "0")
    except OSError:
        pass


def _empty_into(path: str, parent: str) -> None:
    """Move the processes of group ``path`` to the hierarchy's root ``parent``."""
    try:
        with open(os.path.join(path, "cgroup.procs")) as fh:
            pids = fh.read().split()
    except OSError:
        return
    for pid in pids:
        try:
            with open(os.path.join(parent, "cgroup.procs"), "w") as fh:
                fh.write(pid)
        except OSError:
            pass

