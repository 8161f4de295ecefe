"""Availability under attack: root's plain ``curl localhost:PORT/status`` while another user (or
a node) attacks a real run's controller, and the run itself under attack, end to end.

Run as root: ``.venv/bin/python bench/bench_availability.py [--hold-s 8]``.

It starts the default gossip experiment (``gl_run.py``, 8 netns nodes) in a scratch directory,
waits until it is ready, then holds each attack in turn as user ``nobody`` (the attacks of the
security tier, ``tests/security/test_availability.py``), from loopback or from inside node
``n1`` (its namespace, to the controller's address on the bridge), and times ten root calls
spread over the hold. Then it runs the experiment (``/start`` to finished) once while 1,000
idle and 300 trickling connections are held, against the same experiment unattacked. Last, the
pieces that used to cost time in proportion to the attacker's input: ``bounded_json.loads`` of
1 MiB of each adversarial shape, and the lookup of a caller's uid with 10,000 sockets of
``nobody`` open (the exact sock_diag request against a dump of the table). Prints Markdown tables.
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.e2e.harness import Run  # noqa: E402
from tests.security.test_availability import (ADVERSARIAL_1MIB, PRINT_BODY, STATUS_HEAD, STREAM_HEAD,  # noqa: E402
                                               Attacker, hold, raw_post, requests_attacker, root_status_s,
                                               root_statuses)


def log(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


def in_node(run: Run, node: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", f"etb-{run.id}-{node}")


def row(name: str, calls: list[tuple[float, int]], note: str = "") -> dict[str, Any]:
    times = [s for s, code in calls if code]
    return {"attack": name, "calls": len(calls), "answered": sum(1 for _, c in calls if c),
            "p50_ms": round(1000 * statistics.median(times)) if times else None,
            "max_ms": round(1000 * max(times)) if times else None, "note": note}


def attacks(run: Run, hold_s: float) -> list[dict[str, Any]]:
    """Each attack held while root calls /status ten times."""
    port, url = run.port, run.url + "/status"
    bridge = f"10.{run.subnet.split('.')[1]}.0.1"
    node = in_node(run, "n1")
    rows = [row("none", root_statuses(url, hold_s, 10))]
    cases: list[tuple[str, Callable[[], Attacker], str]] = [
        ("1. six 16 KiB /print bodies at once, over and over (loopback)",
         lambda: requests_attacker("127.0.0.1", port, raw_post("/print", PRINT_BODY), 6), "ready"),
        ("2. the same from inside node n1 (the bridge address)",
         lambda: requests_attacker(bridge, port, raw_post("/print", PRINT_BODY), 6, prefix=node), "ready"),
        ("5. 1,000 idle connections (loopback)",
         lambda: hold([{"host": "127.0.0.1", "port": port, "count": 1000}], "idle"), "ready"),
        ("6. 300 + 300 trickling heads (loopback, and from inside n1)",
         lambda: _two(hold([{"host": "127.0.0.1", "port": port, "count": 300}], "trickle", STATUS_HEAD),
                      hold([{"host": bridge, "port": port, "count": 300}], "trickle", STATUS_HEAD, prefix=node)), "ready"),
        ("7. 300 /api/stream readers (loopback)",
         lambda: hold([{"host": "127.0.0.1", "port": port, "count": 300}], "stream", STREAM_HEAD), "ready"),
    ]
    for name, start, ready in cases:
        log(name)
        with start() as attacker:
            attacker.wait_line(ready, 60)
            calls = root_statuses(url, hold_s, 10)
        rows.append(row(name, calls))
    log("8. 300 stream readers leave")
    attacker = hold([{"host": "127.0.0.1", "port": port, "count": 300}], "stream", STREAM_HEAD)
    try:
        attacker.wait_line("ready", 60)
        attacker.leave()
        rows.append(row("8. right after 300 stream readers left", [root_status_s(url)]))
    finally:
        attacker.kill()
    log("9. 300 trickling heads from inside n1; n2 calls the controller")
    with hold([{"host": bridge, "port": port, "count": 300}], "trickle", STATUS_HEAD, prefix=node) as attacker:
        attacker.wait_line("ready", 60)
        calls = [_node_call(run, "n2", f"http://{bridge}:{port}/status") for _ in range(10)]
    rows.append(row("9. n2's call to the bridge address while n1 trickles 300 heads", calls,
                    "401 to a node: answered, not held"))
    return rows


class _two:
    """Two attackers as one (entered, waited for and killed together)."""

    def __init__(self, a: Attacker, b: Attacker) -> None:
        self.both = (a, b)

    def wait_line(self, kind: str, timeout_s: float) -> str:
        return " ".join(a.wait_line(kind, timeout_s) for a in self.both)

    def __enter__(self) -> "_two":
        return self

    def __exit__(self, *exc: Any) -> None:
        for a in self.both:
            a.kill()


def _node_call(run: Run, node: str, url: str) -> tuple[float, int]:
    done = subprocess.run([*in_node(run, node), "curl", "-s", "-o", "/dev/null", "-w", "%{time_total} %{http_code}",
                           "--max-time", "10", "--noproxy", "*", url], capture_output=True, text=True, timeout=30)
    words = done.stdout.split()
    return float(words[0]), int(words[1])


def timed_run(tmp: Path, attacked: bool) -> dict[str, Any]:
    """The default experiment from /start to finished, under 1,000 idle and 300 trickling
    connections of nobody's when ``attacked``."""
    run = Run(tmp)
    held: list[Attacker] = []
    try:
        run.wait_phase("ready", timeout_s=180)
        if attacked:
            held = [hold([{"host": "127.0.0.1", "port": run.port, "count": 1000}], "idle"),
                    hold([{"host": "127.0.0.1", "port": run.port, "count": 300}], "trickle", STATUS_HEAD)]
            for a in held:
                a.wait_line("ready", 60)
        started = time.monotonic()
        assert run.get("/start").status_code == 200
        status = run.wait_phase("finished", "failed", timeout_s=600)
        took = time.monotonic() - started
        finish = root_status_s(run.url + "/finish")
        accs = [n.get("accuracy") for n in status.get("nodes", []) if isinstance(n, dict)]
        return {"run": "under attack" if attacked else "alone", "phase": status["phase"], "start_to_end_s": round(took, 1),
                "finish_call_s": round(finish[0], 2),
                "mean_accuracy": round(statistics.mean(a for a in accs if a is not None), 3) if accs else None}
    finally:
        for a in held:
            a.kill()
        run.close()


def json_shapes() -> list[dict[str, Any]]:
    from dml_app.wire import bounded_json

    rows = []
    for shape, data in ADVERSARIAL_1MIB.items():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            try:
                bounded_json.loads(data)
            except ValueError:
                pass
            best = min(best, time.perf_counter() - t0)
        rows.append({"1 MiB of": shape, "ms": round(1000 * best, 1), "MB/s": round(len(data) / best / 1e6)})
    return rows


# Run as nobody: 5,000 connections to a listener of its own (10,000 sockets), held until stdin closes.
MANY_SOCKETS = r"""
import resource, socket, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(4096)
held = []
for _ in range(5000):
    held.append(socket.create_connection(("127.0.0.1", srv.getsockname()[1]))); held.append(srv.accept()[0])
print("ready", len(held), flush=True)
sys.stdin.read()
"""


def uid_lookup() -> list[dict[str, Any]]:
    from worker.admission import owner_uid
    from worker.sockets import tcp_sockets

    with Attacker(MANY_SOCKETS) as many, socket.socket() as server:
        many.wait_line("ready", 120)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            peer, _ = server.accept()
            with peer:
                here, there = ("127.0.0.1", port), client.getsockname()
                rows = []
                assert owner_uid(there, here) == 0
                for name, look, n in (("exact sock_diag request (worker.admission.owner_uid)",
                                       lambda: owner_uid(there, here), 1000),
                                      ("dump of every socket (how the caller was found before)",
                                       lambda: list(tcp_sockets(listening=False)), 5)):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        look()
                    rows.append({"lookup, 10,000 sockets of nobody open": name,
                                 "ms": round(1000 * (time.perf_counter() - t0) / n, 3)})
                return rows


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join("" if r[k] is None else str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hold-s", type=float, default=8.0, help="how long each attack is held while root calls")
    parser.add_argument("--skip-runs", action="store_true", help="leave out the two timed runs")
    parser.add_argument("--skip-attacks", action="store_true", help="leave out the attacks on a ready run")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="bench-availability-") as tmp:
        if not args.skip_attacks:
            run = Run(Path(tmp))
            try:
                run.wait_phase("ready", timeout_s=180)
                rows = attacks(run, args.hold_s)
            finally:
                run.close()
            print("\n### Root's `curl /status` while each attack is held (10 calls over the hold)\n")
            print(table(rows))
        if not args.skip_runs:
            runs = [timed_run(Path(tmp), False), timed_run(Path(tmp), True)]
            print("\n### The default experiment, /start to finished\n")
            print(table(runs))
    print("\n### Parsing 1 MiB of adversarial JSON (`bounded_json.loads`, best of 3)\n")
    print(table(json_shapes()))
    print("\n### A caller's uid\n")
    print(table(uid_lookup()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
