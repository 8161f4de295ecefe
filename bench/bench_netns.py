"""Benchmarks of the emulation core: bring-up, rule programming, agent memory.

Run as root: ``.venv/bin/python bench/bench_netns.py [--quick]``. Prints Markdown
tables on stdout (progress on stderr); the figures go into BENCHMARKS.md.

1. Bring-up: N netns nodes plus shaped links through ``WorkerHost`` in-process, isolated
   as a deployed testbed is (``--open-network``: without isolation)
   (full mesh up to 100 nodes, a seeded random graph of out-degree 10 at 500).
2. 1,000 per-destination rules (HTB class + u32 filter) on one node: edgetb's
   batched netlink against pyroute2 one request at a time, ``tc -batch``, and
   one ``tc`` process per rule.
3. Memory (RSS) of the real agent process, idle and with 100 shaped nodes.

Every benchmark makes its own testbed (a fresh id), resets it in a ``finally``
block (Ctrl-C and SIGTERM are held back until the reset is done) and checks that
nothing carrying the id is left on the host.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import random
import secrets
import shutil
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import signal  # noqa: E402

from worker.kernel import nsfs  # noqa: E402

from worker.api.errors import ShapingError  # noqa: E402
from worker.api.protocol import NODE_IFNAME  # noqa: E402
from worker.api.shape import Shape, tc_rate  # noqa: E402
from worker.host import WorkerHost  # noqa: E402
from worker.shaping import apply as tc_apply
from worker.shaping.links import SHAPING_THREADS  # noqa: E402
from worker.shaping.plan import DEFAULT_CLASS_RATE_BPS, DEFAULT_MINOR, Plan, Target, make_plan, render  # noqa: E402

SEED = 20261122
TARGET_BRINGUP_S = 5.0  # 100 nodes with shaped links ready
TARGET_RULES_S = 0.2  # 1,000 rules programmed on one node
ID_CHARS = string.ascii_lowercase + string.digits


class BenchError(Exception):
    """A benchmark found something wrong (not a mere slow figure)."""


# output ---------------------------------------------------------------------------------
def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def secs(value: Optional[float], digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# signals and cleanup ------------------------------------------------------------------------
_interrupted = threading.Event()


def _on_signal(signum: int, frame: Any) -> None:
    """Ctrl-C or SIGTERM: remembered, then raised. Remembering matters: a KeyboardInterrupt
    that lands in a weakref callback or __del__ (pyroute2 runs many) is printed and dropped."""
    _interrupted.set()
    raise KeyboardInterrupt(signal.Signals(signum).name)


def checkpoint() -> None:
    """Stop here if an interrupt arrived earlier and was swallowed on the way."""
    if _interrupted.is_set():
        raise KeyboardInterrupt("interrupted")


@contextmanager
def shielded() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while cleaning up; raise KeyboardInterrupt afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[int] = []
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    old = {s: h for s, h in old.items() if h is not signal.SIG_IGN}  # ignored stays ignored
    for s in old:
        signal.signal(s, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if pending:
            log("interrupted during cleanup; cleanup finished first")
            _interrupted.set()
            raise KeyboardInterrupt


def fresh_testbed_id() -> str:
    """'b' + 4 random characters, not used by any namespace or link on this host."""
    links = set(os.listdir("/sys/class/net"))
    spaces = nsfs.list_netns()
    for _ in range(100):
        tid = "b" + "".join(secrets.choice(ID_CHARS) for _ in range(4))
        prefix = f"etb-{tid}-"
        if not any(n.startswith(prefix) for n in spaces) and not any(n.startswith(prefix) for n in links):
            return tid
    raise BenchError("no free testbed id found")


def free_subnet(preferred: str) -> str:
    """``preferred`` unless an address of this host overlaps it; then the first free 10.x.0.0/16."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        used = [ipaddress.IPv4Interface(f"{m.get_attr('IFA_ADDRESS')}/{m['prefixlen']}").network
                for m in ipr.get_addr(family=socket.AF_INET)]
    candidates = [ipaddress.IPv4Network(preferred)] + [ipaddress.IPv4Network(f"10.{b}.0.0/16") for b in range(200, 255)]
    for net in candidates:
        if not any(net.overlaps(u) for u in used):
            if str(net) != preferred:
                log(f"subnet {preferred} is in use on this host; using {net}")
            return str(net)
    raise BenchError(f"no free subnet found near {preferred}")


def teardown(host: WorkerHost) -> dict[str, list[str]]:
    """Reset the testbed; return what carries its id afterwards (only non-empty kinds)."""
    try:
        host.reset()
    except Exception as e:  # still look at what is left, and try once more
        log(f"reset of testbed {host.testbed_id} failed: {type(e).__name__}: {e}")
    left = {k: v for k, v in host.runtime.leftovers().items() if v}
    if left:
        log(f"leftovers after reset of {host.testbed_id}: {left}; resetting again")
        try:
            host.reset()
        except Exception as e:
            log(f"second reset failed: {type(e).__name__}: {e}")
    return left


@contextmanager
def scratch_host(subnet: str) -> Iterator[WorkerHost]:
    """A WorkerHost for a fresh testbed with its own state dir; reset and checked afterwards."""
    state_dir = tempfile.mkdtemp(prefix="edgetb-bench-")
    host = WorkerHost(fresh_testbed_id(), free_subnet(subnet), state_root=state_dir)
    left: dict[str, list[str]] = {}
    try:
        yield host
    finally:
        with shielded():
            left = teardown(host)
            shutil.rmtree(state_dir, ignore_errors=True)
        if left:
            raise BenchError(f"testbed {host.testbed_id}: reset left {left} behind (a product bug)")
        checkpoint()


@contextmanager
def timed_calls(module: Any, names: list[str]) -> Iterator[dict[str, list[float]]]:
    """Record the duration of every call of ``module.<name>`` (from any thread) while active."""
    durations: dict[str, list[float]] = {n: [] for n in names}
    lock = threading.Lock()
    originals = {n: getattr(module, n) for n in names}

    def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    durations[name].append(time.perf_counter() - start)
        return timed

    for n, fn in originals.items():
        setattr(module, n, wrap(n, fn))
    try:
        yield durations
    finally:
        for n, fn in originals.items():
            setattr(module, n, fn)


# 1. bring-up ------------------------------------------------------------------------------------
def graph(n: int, degree: Optional[int], rng: random.Random) -> list[tuple[int, int]]:
    """Full mesh when ``degree`` is None, else each node links to ``degree`` random others."""
    if degree is None:
        return [(i, j) for i in range(n) for j in range(n) if i != j]
    return [(i, j) for i in range(n) for j in rng.sample([k for k in range(n) if k != i], degree)]


def bring_up(n: int, degree: Optional[int], subnet: str, isolated: bool = True) -> list[Any]:
    rng = random.Random(SEED + n)
    edges = graph(n, degree, rng)
    rates = [rng.randint(1, 100) * 10**6 for _ in edges]
    with scratch_host(subnet) as host:
        log(f"  testbed {host.testbed_id}, subnet {host.runtime.subnet}: creating {n} nodes")
        t0 = time.perf_counter()
        nodes = host.create_nodes({"version": 1, "nodes": [{"name": f"n{i}"} for i in range(n)]})["nodes"]
        t1 = time.perf_counter()
        checkpoint()
        body = {"version": 1, "links": [{"src": f"n{i}", "dst": f"n{j}", "dst_ip": nodes[j]["ip"],
                                         "shape": {"rate_bps": r}} for (i, j), r in zip(edges, rates)]}
        if isolated:  # as deploy sends it: the node subnet dropped but by links, its gateway kept
            pairs = set(edges)
            body["isolation"] = {"drop": [str(host.runtime.subnet)], "keep": [host.runtime.bridge_ip]}
            body["unshaped"] = {f"n{k}": [] for k in range(n)}
            for i, j in edges:
                if (j, i) not in pairs:
                    body["unshaped"][f"n{j}"].append({"dst": f"n{i}", "dst_ip": nodes[i]["ip"]})
        log(f"  shaping {len(edges)} links")
        with timed_calls(tc_apply, ["apply", "verify"]) as calls:
            t2 = time.perf_counter()
            result = host.set_links(body)
            t3 = time.perf_counter()
        checkpoint()
        shaped = result["nodes"]
        if len(shaped) != n or sum(s["rules"] for s in shaped) != len(edges) or not all(s["verified"] for s in shaped):
            raise BenchError(f"set_links answered {len(shaped)} nodes / {sum(s['rules'] for s in shaped)} rules, "
                             f"expected {n} / {len(edges)}, all verified")
        # an independent check afterwards, one node at a time: every node's kernel state matches its plan
        t4 = time.perf_counter()
        plans = host.store.read()["plans"]
        for rec in nodes:
            checkpoint()
            tc_apply.verify(rec["netns"], Plan.from_dict(plans[rec["name"]]))
        recheck = time.perf_counter() - t4
    program_sum = sum(calls["apply"])
    verify_sum = sum(calls["verify"])
    nodes_s, shaping_s, total_s = t1 - t0, t3 - t2, (t1 - t0) + (t3 - t2)
    kind = "full mesh" if degree is None else f"random, out-degree {degree}"
    target = f"<= {TARGET_BRINGUP_S:g} s" if n == 100 else "-"
    met = ("met" if total_s <= TARGET_BRINGUP_S else "NOT met") if n == 100 else "-"
    return [n, kind, f"{len(edges):,}", secs(nodes_s), secs(shaping_s), secs(total_s),
            secs(program_sum), secs(verify_sum), secs(recheck), target, met]


# 2. 1,000 rules on one node ---------------------------------------------------------------------------
def _stats(times: list[float]) -> tuple[float, float]:
    return statistics.median(times), min(times)


def rules_1000(reps: int, subnet: str, per_process_rules: int = 100) -> list[list[Any]]:
    from pyroute2 import IPRoute

    rng = random.Random(SEED)
    base = int(ipaddress.IPv4Address("172.30.0.1"))
    targets = [Target(f"d{i}", str(ipaddress.IPv4Address(base + i)), Shape(rng.randint(1, 100) * 10**6))
               for i in range(1000)]
    plan = make_plan(NODE_IFNAME, targets)
    small = Plan(plan.ifname, plan.rules[:per_process_rules])
    rows: list[list[Any]] = []
    with scratch_host(subnet) as host:
        rec = host.create_nodes({"version": 1, "nodes": [{"name": "r"}]})["nodes"][0]
        ns = rec["netns"]
        ifindex = tc_apply.ifindex_in(ns, NODE_IFNAME)

        def run(label: str, program: Callable[[], None], expect: Plan, n_reps: int) -> list[float]:
            """Time ``program`` from a bare interface, ``n_reps`` times; check the kernel state each time."""
            times = []
            for rep in range(n_reps):
                checkpoint()
                tc_apply.clear(ns, NODE_IFNAME)
                start = time.perf_counter()
                program()
                times.append(time.perf_counter() - start)
                try:
                    tc_apply.verify(ns, expect)
                except ShapingError as e:
                    raise BenchError(f"{label}: kernel state differs from the plan: {e.message[:300]}") from None
                log(f"  {label}, run {rep + 1}/{n_reps}: {times[-1]:.3f} s")
            return times

        # (edgetb) batched netlink: program, then verify (read back + compare) on its own
        program_t = run("edgetb program", lambda: tc_apply.apply(ns, plan), plan, reps)
        verify_t = []
        for _ in range(reps):
            start = time.perf_counter()
            tc_apply.verify(ns, plan)
            verify_t.append(time.perf_counter() - start)
        edgetb_median = statistics.median(program_t)

        # (a) pyroute2, one synchronous request per class and per filter
        def pyroute2_sync() -> None:
            with IPRoute(netns=ns, flags=0) as ipr:
                ipr.tc("add", "htb", ifindex, 0x10000, default=DEFAULT_MINOR)
                rate = tc_rate(DEFAULT_CLASS_RATE_BPS)
                ipr.tc("add-class", "htb", ifindex, 0x10000 | DEFAULT_MINOR, parent=0x10000, rate=rate, ceil=rate)
                for rule in plan.rules:
                    rate = tc_rate(rule.shape.rate_bps)
                    ipr.tc("add-class", "htb", ifindex, 0x10000 | rule.minor, parent=0x10000, rate=rate, ceil=rate)
                    ipr.tc("add-filter", "u32", ifindex, (0x800 << 20) | rule.minor, parent=0x10000, prio=1,
                           protocol=0x0800, target=0x10000 | rule.minor,
                           keys=[f"0x{socket.inet_aton(rule.dest_ip).hex()}/0xffffffff+16"])

        pyroute2_t = run("pyroute2 one request per rule", pyroute2_sync, plan, reps)

        # (b) tc -batch: the plan's own tc lines, in one tc process
        lines = [line[len("tc "):] for line in render(plan)]
        with tempfile.NamedTemporaryFile("w", prefix="edgetb-bench-", suffix=".tc", delete=False) as f:
            f.write("\n".join(lines) + "\n")
            batch_file = f.name
        try:
            def tc_batch() -> None:
                done = subprocess.run(["ip", "netns", "exec", ns, "tc", "-batch", batch_file],
                                      capture_output=True, text=True)
                if done.returncode != 0:
                    raise BenchError(f"tc -batch failed: {done.stderr.strip()[:300]}")

            batch_t = run("tc -batch", tc_batch, plan, reps)
        finally:
            os.unlink(batch_file)

        # (c) one tc process per command, for the first rules; extrapolated to 1,000
        small_lines = [line[len("tc "):].split() for line in render(small)]
        head, rule_lines = small_lines[:2], small_lines[2:]

        def tc_commands(argvs: list[list[str]]) -> None:
            for argv in argvs:
                checkpoint()
                done = subprocess.run(["ip", "netns", "exec", ns, "tc", *argv], capture_output=True, text=True)
                if done.returncode != 0:
                    raise BenchError(f"tc {' '.join(argv)} failed: {done.stderr.strip()[:300]}")

        per_process_t = []
        for rep in range(reps):
            checkpoint()
            tc_apply.clear(ns, NODE_IFNAME)
            tc_commands(head)  # root and default class, not timed
            start = time.perf_counter()
            tc_commands(rule_lines)
            per_process_t.append((time.perf_counter() - start) * len(plan.rules) / len(small.rules))
            tc_apply.verify(ns, small)
            log(f"  one tc process per command, run {rep + 1}/{reps}: {per_process_t[-1]:.2f} s extrapolated")
        tc_apply.clear(ns, NODE_IFNAME)

    def row(label: str, times: list[float], target: str = "-", digits: int = 3) -> list[Any]:
        median, best = _stats(times)
        return [label, secs(median, digits), secs(best, digits), f"{median / edgetb_median:.1f}x", target]

    met = "met" if edgetb_median <= TARGET_RULES_S else "NOT met"
    rows.append(row("edgetb: batched netlink, program (tc_apply.apply)", program_t,
                    f"<= {TARGET_RULES_S:g} s: {met}"))
    rows.append(row("edgetb: read back + compare (tc_apply.verify)", verify_t))
    rows.append(row("(a) pyroute2, one synchronous request per class/filter", pyroute2_t))
    rows.append(row("(b) tc -batch (one tc process, via ip netns exec)", batch_t))
    rows.append(row(f"(c) one tc process per command: {len(small.rules)} rules timed, "
                    f"**extrapolated** to {len(plan.rules):,}", per_process_t, digits=2))
    return rows


# 3. agent memory ------------------------------------------------------------------------------------
def proc_memory_kib(pid: int) -> dict[str, int]:
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(line.split()[1])
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_memory(subnet: str, n: int = 100) -> list[list[Any]]:
    from controller.workers.agent_client import AgentClient

    subnet = free_subnet(subnet)
    tid = fresh_testbed_id()
    port = free_port()
    token = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))
    state_dir = tempfile.mkdtemp(prefix="edgetb-bench-agent-")
    log_path = os.path.join(tempfile.gettempdir(), f"edgetb-bench-agent-{tid}.log")
    env = dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=state_dir)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    rows: list[list[Any]] = []

    def sample(label: str, seconds: Optional[float] = None) -> None:
        checkpoint()
        mem = proc_memory_kib(proc.pid)
        rows.append([label, f"{mem['VmRSS'] / 1024:.1f}", f"{mem['VmHWM'] / 1024:.1f}", secs(seconds)])
        log(f"  {label}: RSS {mem['VmRSS'] / 1024:.1f} MiB")

    log(f"  starting agent: testbed {tid}, port {port}, subnet {subnet}")
    with open(log_path, "wb") as agent_log:
        # own session: a Ctrl-C at the terminal reaches us, not the agent, so we can reset it first
        proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port),
                                 "--listen", "127.0.0.1", "--plain-http",
                                 "--id", tid, "--subnet", subnet], env=env, cwd=ROOT, stdin=subprocess.DEVNULL,
                                stdout=agent_log, stderr=subprocess.STDOUT, start_new_session=True)
    client = AgentClient(f"http://127.0.0.1:{port}", token, timeout_s=600)
    left: dict[str, list[str]] = {}
    try:
        deadline = time.monotonic() + 30
        while True:
            if proc.poll() is not None:
                raise BenchError(f"agent exited with {proc.returncode}: {_tail(log_path)}")
            try:
                if client.health().get("testbed_id") != tid:
                    raise BenchError(f"port {port} answers for another testbed")
                break
            except BenchError:
                raise
            except Exception:
                if time.monotonic() > deadline:
                    raise BenchError(f"agent did not answer within 30 s: {_tail(log_path)}") from None
                time.sleep(0.05)
        client.status()  # an authenticated call, so the request path is loaded
        sample("idle (after /health and /status)")
        start = time.perf_counter()
        nodes = client.create_nodes({"version": 1, "nodes": [{"name": f"n{i}"} for i in range(n)]})["nodes"]
        sample(f"after creating {n} nodes", time.perf_counter() - start)
        rng = random.Random(SEED)
        links = [{"src": a["name"], "dst": b["name"], "dst_ip": b["ip"],
                  "shape": {"rate_bps": rng.randint(1, 100) * 10**6}} for a in nodes for b in nodes if a is not b]
        start = time.perf_counter()
        shaped = client.set_links({"version": 1, "links": links})["nodes"]
        elapsed = time.perf_counter() - start
        if sum(s["rules"] for s in shaped) != len(links):
            raise BenchError(f"agent shaped {sum(s['rules'] for s in shaped)} links, expected {len(links)}")
        client.status()
        sample(f"after shaping {len(links):,} links (full mesh)", elapsed)
        start = time.perf_counter()
        client.reset()
        sample("after reset", time.perf_counter() - start)
    finally:
        with shielded():
            if proc.poll() is None:
                try:
                    client.reset()
                except Exception as e:
                    log(f"agent reset failed: {type(e).__name__}: {e}")
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    log("agent ignored SIGTERM for 15 s; killing it")
                    proc.kill()
                    proc.wait()
            # whatever the agent did or did not manage, nothing of its testbed may remain
            left = teardown(WorkerHost(tid, subnet, state_root=state_dir))
            shutil.rmtree(state_dir, ignore_errors=True)
            failing = sys.exc_info()[0]
            if proc.returncode not in (0, -signal.SIGTERM) or (failing and failing is not KeyboardInterrupt):
                log(f"agent exited with {proc.returncode}; its log is kept: {log_path}")
            else:
                os.unlink(log_path)
        if left:
            raise BenchError(f"agent testbed {tid}: reset left {left} behind (a product bug)")
    return rows


def _tail(path: str, chars: int = 600) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:].strip() or "(no output)"
    except OSError:
        return "(no log)"


# main -----------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="bring-up at N = 10 and 100 only, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="repetitions of the 1,000-rule runs (default 5)")
    parser.add_argument("--only", nargs="+", choices=["bringup", "rules", "agent"],
                        help="run only these benchmarks")
    parser.add_argument("--open-network", action="store_true",
                        help="bring-up without isolation (default: isolated, as a deployed testbed)")
    parser.add_argument("--subnet", default="10.250.0.0/16",
                        help="node subnet (another free 10.x.0.0/16 is taken if it is in use)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench: run as root (network namespaces, tc)", file=sys.stderr)
        return 2
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _on_signal)
    reps = args.reps or (1 if args.quick else 5)
    wanted = set(args.only or ["bringup", "rules", "agent"])
    import pyroute2

    print(f"# edgetb emulation-core benchmarks\n\n{time.strftime('%Y-%m-%d %H:%M')}, Linux {os.uname().release}, "
          f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, pyroute2 {pyroute2.__version__}, "
          f"load average at start {os.getloadavg()[0]:.2f}{', --quick' if args.quick else ''}\n", flush=True)
    failed: list[str] = []

    def attempt(name: str, fn: Callable[[], Any]) -> Any:
        checkpoint()
        try:
            return fn()
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as e:
            traceback.print_exc()
            failed.append(f"{name}: {type(e).__name__}: {e}")
            print(f"\n**{name} failed:** {type(e).__name__}: {e}\n", flush=True)
            return None

    try:
        if "bringup" in wanted:
            sizes: list[tuple[int, Optional[int]]] = [(10, None), (100, None)] + ([] if args.quick else [(500, 10)])
            rows = []
            for n, degree in sizes:
                log(f"bring-up: {n} nodes")
                row = attempt(f"bring-up of {n} nodes",
                              lambda: bring_up(n, degree, args.subnet, not args.open_network))
                if row:
                    rows.append(row)
            print(f"## 1. Bring-up: nodes created, every link shaped and verified (WorkerHost, in-process, "
                  f"{'open network' if args.open_network else 'isolated: no link, no path'})\n")
            print(table(["nodes", "graph", "directed links", "nodes s", "shaping s", "total s",
                         "program Σ s", "verify Σ s", "re-verify s", "target", "result"], rows))
            print(f"\nshaping s: `set_links` wall time (plan, program, read back + compare, save state) "
                  f"with {SHAPING_THREADS} shaping threads. program Σ / verify Σ: time inside "
                  f"`tc_apply.apply` / `tc_apply.verify` summed over all calls of those threads (can exceed "
                  f"the wall time). re-verify s: verifying every node again afterwards, one at a time "
                  f"(not in total).\n", flush=True)

        if "rules" in wanted:
            log("1,000 rules on one node")
            rows = attempt("1,000 rules", lambda: rules_1000(reps, args.subnet))
            if rows:
                print(f"## 2. 1,000 per-destination rules (HTB class + u32 filter) on one node, "
                      f"median and best of {reps}\n")
                print(table(["method", "median s", "best s", "vs edgetb program", "target"], rows))
                print("\nEvery run starts from a bare interface and ends with the same kernel state (root, "
                      "default class, 1,000 classes and filters), checked with `tc_apply.verify`; opening the "
                      "netlink socket or starting the process is inside the timing.\n", flush=True)

        if "agent" in wanted:
            log("agent memory")
            rows = attempt("agent memory", lambda: agent_memory(args.subnet))
            if rows:
                print("## 3. Agent memory (`python -m worker.agent`, driven by AgentClient)\n")
                print(table(["agent state", "VmRSS MiB", "VmHWM (peak) MiB", "call s"], rows))
                print(flush=True)
        checkpoint()
    except KeyboardInterrupt:
        log("interrupted; every testbed made so far was reset")
        return 130
    if failed:
        log("failed: " + "; ".join(failed))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
