"""Availability: what another local user, or anyone who reaches the controller's port, can make
the controller stop answering. The real app on a real socket, attacked by real processes of
user ``nobody``; root's plain ``curl http://127.0.0.1:PORT/status`` must keep its answer.

Attacks from the audit, each asserted to fail while it is held:

1. six 16 KiB /print bodies at once, over and over (an unclosed string of escaped quotes, then
   brackets: quadratic for a backtracking nesting scan), with no valid signature;
2. the same from a non-loopback address (the nodes' listener);
3. a node's events file with such a 48 KB line: read by /finish and the stored view; 1 MiB
   lines refused or parsed by ``bounded_json.loads`` in linear time;
4. ``GET /api/runs/<id>`` of a stored run whose events hold that line, in a loop;
5. 1000 idle connections;
6. 600 connections trickling a request head a byte every 10 s, half from loopback, half from
   a non-loopback address; a trickle must not outlast a deadline for the whole head;
7. 300 readers of ``/api/stream``;
8. ... which then leave: their places are free at once;
9. 300 trickling connections from one non-loopback address cannot take the place of a caller
   from another address.

Helpers (used by ``test_agent_handshake`` too): ``Attacker`` (a script run as nobody in the
background, which prints ``ready`` once its attack is in place, ``status`` lines as it holds it,
and stops when its stdin closes), ``HOLD`` (connections held idle, trickling or reading a
stream, re-opened when the server closes them), ``REQUESTS`` (a raw request sent by N callers
at once, in rounds), ``root_status_s`` / ``root_statuses`` (root's curl, timed), ``dummy_net``
(a veth pair, both ends here, with three non-loopback addresses).
"""
from __future__ import annotations

import ipaddress
import json
import os
import random
import secrets
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import pytest

from tests.security.callers_fixtures import NOBODY_UID, need_root
from tests.security.test_controller_callers import make_controller  # noqa: F401  (fixture)

pytestmark = [pytest.mark.security, pytest.mark.skipif(os.geteuid() != 0, reason="needs root")]

ROOT_BOUND_S = 1.5  # root's /status while an attack is held (the target is 1 s; CI is a loaded 2-core box)
REFUSAL_BOUND_S = 1.0  # an attacker's refused request is answered within this
AFTER_LEAVE_BOUND_S = 2.0  # once stream readers leave, their places are free within this
HEAD_DEADLINE_BOUND_S = 18.0  # a request head (or TLS handshake) trickled must be cut within ~15 s
PARSE_BOUND_S = 1.0  # reading a node's events file with a poisoned line
LOADS_BOUND_S = 0.2  # bounded_json.loads of a 1 MiB adversarial line (the target is 0.1 s)
ROOT_CHECKS = 5  # root's calls per hold, spread over it
CURL_MAX_S = 10

# the audit's /print body: a quote, 8159 escaped quotes, 65 brackets (16 KiB, the route's limit)
PRINT_BODY = b'"' + b'\\"' * 8159 + b"[" * 65
STATUS_HEAD = "GET /status HTTP/1.1\r\nHost: localhost\r\n\r\n"
STREAM_HEAD = "GET /api/stream HTTP/1.1\r\nHost: localhost\r\n\r\n"


def poisoned_line(size: int, prefix: bytes = b'{"a": "') -> bytes:
    """``prefix``, escaped quotes (an unclosed string) and 65 brackets: ``size`` bytes."""
    return prefix + b'\\"' * ((size - len(prefix) - 65) // 2) + b"[" * 65


# --- attackers ----------------------------------------------------------------------------------

# Run as nobody: connections to each group's (host, port) (from its source address, if any),
# held: "idle" (nothing sent), "trickle" (the payload a byte every `interval` s) or "stream" (the
# payload at once, then whatever comes is read). A connection the server closes is opened again
# after `retry` s. Prints "ready {...}" once every connection was tried and has connected (or
# `settle` s went by), "status {...}" every second, "closed <lifetime s>" per connection the
# server closed (with report_closes), and "left {...}" once it closed everything when its stdin
# closed.
HOLD = r"""
import errno, json, os, resource, selectors, socket, sys, time

cfg = json.loads(sys.argv[1])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
groups = cfg["groups"]
mode = cfg["mode"]
payload = cfg.get("payload", "").encode("latin-1")
interval = float(cfg.get("interval", 10.0))
retry = float(cfg.get("retry", 0.5))
settle = float(cfg.get("settle", 2.0))
report_closes = bool(cfg.get("report_closes", False))
OPEN_PER_TICK = 100

sel = selectors.DefaultSelector()
sel.register(0, selectors.EVENT_READ, None)
slots = [{"g": g, "sock": None, "state": "none", "retry_at": 0.0, "t": 0.0, "sent": 0, "next": 0.0, "got": 0,
          "tries": 0} for g, group in enumerate(groups) for _ in range(group["count"])]
stats = {"opened": 0, "closed_by_server": 0, "failed": 0, "longest_closed_s": 0.0}

def say(kind, text):
    sys.stdout.write(kind + " " + text + "\n")
    sys.stdout.flush()

def snapshot(now):
    open_ = [s for s in slots if s["state"] == "open"]
    return dict(stats, open=len(open_), connecting=sum(s["state"] == "connecting" for s in slots),
                reading=sum(1 for s in open_ if s["got"]),
                oldest_open_s=round(max((now - s["t"] for s in open_), default=0.0), 2))

def drop(slot, now, by_server):
    s = slot["sock"]
    try:
        sel.unregister(s)
    except (KeyError, ValueError):
        pass
    s.close()
    if by_server:
        lived = now - slot["t"]
        stats["closed_by_server"] += 1
        stats["longest_closed_s"] = round(max(stats["longest_closed_s"], lived), 2)
        if report_closes:
            say("closed", "%.3f" % lived)
    else:
        stats["failed"] += 1
    slot.update(sock=None, state="none", retry_at=now + retry, got=0, sent=0)

def start(slot, now):
    group = groups[slot["g"]]
    slot["tries"] += 1
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        if group.get("source"):
            s.bind((group["source"], 0))
        err = s.connect_ex((group["host"], group["port"]))
    except OSError:
        err = -1
    if err not in (0, errno.EINPROGRESS):
        s.close()
        stats["failed"] += 1
        slot["retry_at"] = now + retry
        return
    slot.update(sock=s, state="connecting", t=now)
    sel.register(s, selectors.EVENT_WRITE, slot)

def send_byte(slot, now):
    b = payload[slot["sent"] % len(payload):][:1]
    try:
        slot["sock"].send(b)
    except BlockingIOError:
        return
    except OSError:
        drop(slot, now, True)
        return
    slot["sent"] += 1
    slot["next"] = now + interval

ready = False
all_tried_at = None
last_status = 0.0
while True:
    now = time.monotonic()
    budget = OPEN_PER_TICK
    for slot in slots:
        if budget <= 0:
            break
        if slot["state"] == "none" and slot["retry_at"] <= now and (slot["tries"] == 0 or ready or all_tried_at):
            start(slot, now)
            budget -= 1
    if all_tried_at is None and all(s["tries"] for s in slots):
        all_tried_at = now
    for key, _ in sel.select(timeout=0.05):
        slot = key.data
        now = time.monotonic()
        if slot is None:  # stdin: closed means leave
            if not os.read(0, 4096):
                for s in slots:
                    if s["sock"] is not None:
                        s["sock"].close()
                say("left", json.dumps(snapshot(now)))
                sys.exit(0)
            continue
        if slot["sock"] is None or key.fileobj is not slot["sock"]:
            continue
        s = slot["sock"]
        if slot["state"] == "connecting":
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                drop(slot, now, False)
                continue
            slot.update(state="open", t=now)
            stats["opened"] += 1
            sel.modify(s, selectors.EVENT_READ, slot)
            if mode == "stream":
                try:
                    s.sendall(payload)
                except OSError:
                    drop(slot, now, True)
            elif mode == "trickle":
                send_byte(slot, now)
            continue
        try:
            data = s.recv(65536)
        except BlockingIOError:
            continue
        except OSError:
            data = b""
        if data:
            slot["got"] += len(data)
        else:
            drop(slot, now, True)
    now = time.monotonic()
    if mode == "trickle":
        for slot in slots:
            if slot["state"] == "open" and slot["next"] <= now:
                send_byte(slot, now)
    if not ready and all_tried_at is not None:
        snap = snapshot(now)
        if snap["open"] == len(slots) or now - all_tried_at >= settle:
            ready = True
            say("ready", json.dumps(snap))
    if now - last_status >= 1.0:
        last_status = now
        say("status", json.dumps(snapshot(now)))
"""

# Run as nobody: `parallel` callers at once, each sending `request` (raw HTTP, latin-1) to (host,
# port) from `source`, in rounds until stdin closes; each records the seconds until the status
# line came, and the status. Prints "ready" once the first round is sent, then "results [...]".
# With stop_after_slow_s, no round starts after one that had a slower call (a server that
# parses in quadratic time would otherwise owe minutes of work, in the test's process).
REQUESTS = r"""
import json, os, socket, sys, threading, time

cfg = json.loads(sys.argv[1])
request = cfg["request"].encode("latin-1")
parallel, timeout = int(cfg["parallel"]), float(cfg.get("timeout", 10.0))
stop = threading.Event()
results = []
lock = threading.Lock()

def leave():
    while os.read(0, 4096):
        pass
    stop.set()

def call(sem):
    t0 = time.monotonic()
    status, error = None, ""
    told = []

    class sent:  # released once per call
        @staticmethod
        def release():
            if not told:
                told.append(1)
                sem.release()
    try:
        s = socket.socket()
        s.settimeout(timeout)
        if cfg.get("source"):
            s.bind((cfg["source"], 0))
        s.connect((cfg["host"], cfg["port"]))
        try:
            try:
                s.sendall(request)
            except OSError as e:  # refused before the body was read: the answer may be there
                error = "send: %s" % e
            sent.release()
            got = b""
            while b"\r\n" not in got:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            elapsed = time.monotonic() - t0
            words = got.split(b"\r\n", 1)[0].split()
            if len(words) >= 2 and words[1].isdigit():
                status = int(words[1])
            else:
                error = error or "no answer: %r" % got[:60]
        finally:
            s.close()
    except OSError as e:
        sent.release()
        elapsed = time.monotonic() - t0
        error = error or "%s: %s" % (type(e).__name__, e)
    sent.release()
    with lock:
        results.append([round(elapsed, 3), status, error])

threading.Thread(target=leave, daemon=True).start()
first = True
while not stop.is_set():
    sent = threading.Semaphore(0)
    callers = [threading.Thread(target=call, args=(sent,)) for _ in range(parallel)]
    for t in callers:
        t.start()
    if first:
        for _ in range(parallel):
            sent.acquire()
        print("ready", flush=True)
        first = False
    for t in callers:
        t.join()
    slow = cfg.get("stop_after_slow_s")
    if slow is not None and any(r[1] is None or r[0] > slow for r in results):
        print("slow", flush=True)  # the attack worked: no more work piled on the server
        stop.wait()
print("results " + json.dumps(results), flush=True)
"""


class Attacker:
    """``script`` run by /usr/bin/python3 as nobody in the background, its arguments ``args``
    (after ``prefix``: e.g. ``ip netns exec NS``, to attack from inside a node); its stdout
    lines collected; stopped by closing its stdin (``leave``) or killed (``kill``)."""

    def __init__(self, script: str, *args: Any, uid: int = NOBODY_UID, prefix: tuple[str, ...] = ()) -> None:
        argv = [*prefix, "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3", "-c", script,
                *map(str, args)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd="/")
        self.lines: list[str] = []
        self.errors: list[str] = []
        self._seen = threading.Condition()
        self._threads = [threading.Thread(target=self._read, args=(self.proc.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, self.errors), daemon=True)]
        for t in self._threads:
            t.start()

    def _read(self, stream: Any, into: list[str]) -> None:
        try:
            for line in stream:
                with self._seen:
                    into.append(line.rstrip("\n"))
                    self._seen.notify_all()
        except (OSError, ValueError):  # closed by kill()
            pass
        with self._seen:
            self._seen.notify_all()

    def wait_line(self, kind: str, timeout_s: float, after: int = 0) -> str:
        """The text after ``kind`` of the first line (from index ``after``) that starts with it;
        AssertionError when none came within ``timeout_s`` or the script ended first."""
        deadline = time.monotonic() + timeout_s
        with self._seen:
            while True:
                for line in self.lines[after:]:
                    if line.split(" ", 1)[0] == kind:
                        return line[len(kind):].strip()
                ended = self.proc.poll() is not None and not any(t.is_alive() for t in self._threads[:1])
                left = deadline - time.monotonic()
                if ended or left <= 0:
                    raise AssertionError(f"no {kind!r} line from the attacker within {timeout_s} s "
                                         f"(exit {self.proc.poll()}): {self.lines[-5:]} {self.errors[-20:]}")
                self._seen.wait(min(left, 0.2))

    def wait_json(self, kind: str, timeout_s: float) -> Any:
        return json.loads(self.wait_line(kind, timeout_s))

    def last(self, kind: str) -> Optional[Any]:
        with self._seen:
            for line in reversed(self.lines):
                if line.split(" ", 1)[0] == kind:
                    return json.loads(line[len(kind):].strip())
        return None

    def all(self, kind: str) -> list[str]:
        with self._seen:
            return [line[len(kind):].strip() for line in self.lines if line.split(" ", 1)[0] == kind]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def leave(self, timeout_s: float = 20) -> None:
        """Close its stdin: it stops (and says so); killed if it does not within ``timeout_s``."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
        for t in self._threads:
            t.join(5)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass

    def __enter__(self) -> "Attacker":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.kill()


def hold(groups: list[dict], mode: str, payload: str = "", interval: float = 10.0, uid: int = NOBODY_UID,
         prefix: tuple[str, ...] = (), **kw: Any) -> Attacker:
    """A ``HOLD`` attacker (as ``uid``, after ``prefix``); each group ``{"host", "port", "count", "source"?}``."""
    return Attacker(HOLD, json.dumps({"groups": groups, "mode": mode, "payload": payload, "interval": interval, **kw}),
                    uid=uid, prefix=prefix)


def raw_post(path: str, body: bytes, content_type: str = "application/json") -> str:
    head = (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    return (head + body).decode("latin-1")


def raw_get(path: str) -> str:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def requests_attacker(host: str, port: int, request: str, parallel: int, source: Optional[str] = None,
                      prefix: tuple[str, ...] = (), stop_after_slow_s: Optional[float] = None) -> Attacker:
    return Attacker(REQUESTS, json.dumps({"host": host, "port": port, "source": source, "request": request,
                                          "parallel": parallel, "timeout": CURL_MAX_S,
                                          "stop_after_slow_s": stop_after_slow_s}), prefix=prefix)


# --- root's calls -------------------------------------------------------------------------------

def _curl_argv(url: str, interface: Optional[str]) -> list[str]:
    argv = ["curl", "-s", "-o", "/dev/null", "-w", "%{time_total} %{http_code}", "--max-time", str(CURL_MAX_S),
            "--noproxy", "*"]
    if interface:
        argv += ["--interface", interface]
    return [*argv, url]


def _curl_result(out: str) -> tuple[float, int]:
    words = out.split()
    return float(words[0].replace(",", ".")), int(words[1])


def root_status_s(url: str, interface: Optional[str] = None) -> tuple[float, int]:
    """Root's ``curl`` of ``url`` (this test process is root): (seconds, HTTP status; 0 for none)."""
    done = subprocess.run(_curl_argv(url, interface), capture_output=True, text=True, timeout=CURL_MAX_S + 10)
    return _curl_result(done.stdout)


def root_statuses(url: str, over_s: float, n: int = ROOT_CHECKS, interface: Optional[str] = None,
                  alive: Optional[Attacker] = None) -> list[tuple[float, int]]:
    """``n`` root curls of ``url`` started evenly over ``over_s`` seconds (each on its own, so
    that one held call does not delay the next): [(seconds, status)], in order. With ``alive``,
    asserts that attacker still runs when the last call starts."""
    procs: list[subprocess.Popen] = []
    start = time.monotonic()
    try:
        for i in range(n):
            at = start + i * over_s / max(1, n - 1)
            time.sleep(max(0.0, at - time.monotonic()))  # pacing the calls, not waiting for a condition
            if alive is not None and i == n - 1:
                assert alive.alive(), f"the attacker ended before the hold did: {alive.errors[-20:]}"
            procs.append(subprocess.Popen(_curl_argv(url, interface), stdout=subprocess.PIPE,
                                          stderr=subprocess.DEVNULL, text=True))
        return [_curl_result(p.communicate(timeout=CURL_MAX_S + 10)[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def assert_root_answered(calls: list[tuple[float, int]], bound_s: float = ROOT_BOUND_S, what: str = "") -> None:
    worst = max(s for s, _ in calls)
    assert all(code == 200 for _, code in calls) and worst <= bound_s, (
        f"root's /status{what}: worst {worst:.2f} s (bound {bound_s} s), calls (s, status) {calls}")


# --- a veth pair in this namespace: non-loopback addresses of this machine -------------------------

@dataclass
class DummyNet:
    name: str
    server: str  # 10.251.X.1: where the controller is reached (it listens on 0.0.0.0)
    attacker: str  # 10.251.X.2
    other: str  # 10.251.X.3: a legitimate caller from another address


def _used_third_octets() -> set[int]:
    out = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True).stdout
    used = set()
    for word in out.split():
        try:
            net = ipaddress.IPv4Interface(word).network
        except ValueError:
            continue
        if net.overlaps(ipaddress.IPv4Network("10.251.0.0/16")):
            used.add(int(str(net.network_address).split(".")[2]))
    return used


@pytest.fixture
def dummy_net():
    """A veth pair ``etbsec<4 hex>`` (both ends here: this kernel may have no dummy interfaces)
    with 10.251.X.1, .2 and .3 (/24) on one end, removed afterwards."""
    need_root()
    if not shutil.which("ip"):
        pytest.skip("iproute2 not installed")
    name = "etbsec" + secrets.token_hex(2)
    free = [x for x in range(1, 255) if x not in _used_third_octets()]
    x = random.choice(free)
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", name + "p"],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    try:
        for k in (1, 2, 3):
            subprocess.run(["ip", "addr", "add", f"10.251.{x}.{k}/24", "dev", name], check=True, capture_output=True)
        for end in (name, name + "p"):
            subprocess.run(["ip", "link", "set", end, "up"], check=True, capture_output=True)
        yield DummyNet(name, f"10.251.{x}.1", f"10.251.{x}.2", f"10.251.{x}.3")
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


# --- 1, 2: /print bodies that are slow to scan --------------------------------------------------

def _print_flood(served: Any, host: str, source: Optional[str], hold_s: float = 6.0) -> None:
    request = raw_post("/print", PRINT_BODY)
    assert len(PRINT_BODY) == 16 * 1024
    with requests_attacker(host, served.port, request, 6, source) as attacker:
        attacker.wait_line("ready", 30)
        calls = root_statuses(served.url + "/status", hold_s, alive=attacker)
        attacker.leave(CURL_MAX_S + 15)
        results = json.loads(attacker.wait_line("results", 5))
    assert len(results) >= 6, results
    slow = [r for r in results if r[1] is None or not 400 <= r[1] < 500 or r[0] > REFUSAL_BOUND_S]
    worst = max(r[0] for r in results)
    assert_root_answered(calls, what=f" while /print was flooded ({len(results)} posts, worst refusal {worst:.2f} s)")
    assert not slow, (f"{len(slow)} of {len(results)} posts not refused (4xx) within {REFUSAL_BOUND_S} s, "
                      f"worst {worst:.2f} s: {slow[:10]}")


def test_print_bodies_slow_to_scan_do_not_hold_the_controller(make_controller):
    _, served, _ = make_controller()
    _print_flood(served, "127.0.0.1", None)


def test_print_bodies_slow_to_scan_from_another_address_do_not_hold_the_controller(make_controller, dummy_net):
    _, served, _ = make_controller()
    _print_flood(served, dummy_net.server, dummy_net.attacker)


# --- 3, 4: a node's events with a poisoned line ---------------------------------------------------

def _events(node: str, t0: float) -> list[bytes]:
    base = {"v": 1, "run_id": "poisoned", "node": node}
    return [json.dumps({**base, "type": "started", "t": t0, "role": "gossip"}).encode(),
            json.dumps({**base, "type": "round", "t": t0 + 1, "round": 1, "t_start": t0, "t_end": t0 + 1,
                        "accuracy": 0.5, "loss": 1.0, "bytes_sent": 10}).encode(),
            poisoned_line(48_000),
            json.dumps({**base, "type": "done", "t": t0 + 2}).encode()]


def stored_poisoned_run(workdir: Any, run_id: str = "poisoned-run", poisoned: tuple = ("n1", "n2")) -> Any:
    """A stored run in ``workdir``'s ``dml_file/log/`` (run.json, topology.json, each node's
    events, a 48 KB poisoned line among the valid events of the ``poisoned`` ones): its folder."""
    run = workdir / "dml_file" / "log" / run_id
    (run / "events").mkdir(parents=True)
    t0 = time.time() - 100
    (run / "run.json").write_text(json.dumps({
        "version": 1, "run_id": run_id, "algorithm": "gossip", "started_at": t0, "ended_at": t0 + 3,
        "ended": "completed", "nodes": {"n1": "done", "n2": "done"}}))
    (run / "topology.json").write_text(json.dumps({
        "nodes": [{"name": "n1", "ip": "10.0.0.1"}, {"name": "n2", "ip": "10.0.0.2"}],
        "links": [{"src": "n1", "dst": "n2", "rate_bps": 10_000_000}, {"src": "n2", "dst": "n1", "rate_bps": 10_000_000}]}))
    for node in ("n1", "n2"):
        lines = [line for line in _events(node, t0) if node in poisoned or not line.startswith(b'{"a"')]
        (run / "events" / f"{node}.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    return run


PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD_TIMEOUT_S = 10.0  # a parse that has not ended by then is reported, not waited for


def timed_child(code: str, timeout_s: float = CHILD_TIMEOUT_S, **names: Any) -> dict:
    """``code`` run by this interpreter in a child process in the checkout, with ``names`` (JSON
    values) defined and a dict ``out`` it fills (timings with ``time.perf_counter``): ``out``, or
    ``{"timeout": timeout_s}`` when the child was still running then (it is killed)."""
    script = ("import json, sys, time\nout = {}\n" + "".join(f"{k} = json.loads({json.dumps(json.dumps(v))})\n"
                                                              for k, v in names.items())
              + code + "\nprint(json.dumps(out))\n")
    try:
        done = subprocess.run([sys.executable, "-c", script], cwd=PROJECT, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"timeout": timeout_s}
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def took_s(out: dict) -> str:
    return f"did not end within {out['timeout']} s" if "timeout" in out else f"took {out['s']:.3f} s"


def test_a_poisoned_events_line_is_skipped_quickly(tmp_path):
    """How /finish and the stored view read a node's events, each timed on a real file."""
    from dml_app.runtime.events import MAX_LINE_BYTES

    assert len(poisoned_line(48_000)) < MAX_LINE_BYTES  # parsed, not skipped for its length
    run = stored_poisoned_run(tmp_path)
    path = str(run / "events" / "n1.jsonl")
    out = timed_child("from dml_app.runtime.events import read_events\n"
                      "t0 = time.perf_counter(); events = read_events(path); out['s'] = time.perf_counter() - t0\n"
                      "out['types'] = [e['type'] for e in events]", path=path)
    assert out.get("s", 1e9) < PARSE_BOUND_S, f"read_events of a file with a 48 KB poisoned line {took_s(out)}"
    assert out["types"] == ["started", "round", "done"], out
    # what /finish does with an upload (Experiment._store_log): the node settles from its events
    out = timed_child("from controller.run.nodes import NodeState, State\n"
                      "node = NodeState('n1', state=State.RUNNING); body = open(path, 'rb').read()\n"
                      "t0 = time.perf_counter(); node.settle_from_events(body); out['s'] = time.perf_counter() - t0\n"
                      "out['state'] = str(node.state)", path=path)
    assert out.get("s", 1e9) < PARSE_BOUND_S, f"NodeState.settle_from_events {took_s(out)}"
    assert out["state"] == "done", out
    # /finish's results and the analysis read every node's events
    out = timed_child("from controller.results.run_dir import read_run_events\n"
                      "t0 = time.perf_counter(); by_node = read_run_events(run); out['s'] = time.perf_counter() - t0\n"
                      "out['counts'] = {n: len(es) for n, es in by_node.items()}", run=str(run))
    assert out.get("s", 1e9) < 2 * PARSE_BOUND_S, f"read_run_events (two poisoned files) {took_s(out)}"
    assert out["counts"] == {"n1": 3, "n2": 3}, out
    out = timed_child("from controller.web.run_view import stored_view\n"
                      "t0 = time.perf_counter(); view = stored_view(run); out['s'] = time.perf_counter() - t0\n"
                      "out['nodes'] = [[n['name'], n['role']] for n in view['nodes']]", run=str(run))
    assert out.get("s", 1e9) < 2 * PARSE_BOUND_S, f"stored_view (two poisoned files, each read twice) {took_s(out)}"
    assert out["nodes"] == [["n1", "gossip"], ["n2", "gossip"]], out


def mib_of(pattern: bytes, tail: bytes = b"") -> bytes:
    """``pattern`` repeated to 1 MiB, ``tail`` at the end."""
    size = (1 << 20) - len(tail)
    return (pattern * (size // len(pattern) + 1))[:size] + tail


ADVERSARIAL_1MIB = {
    "unclosed string of escaped quotes, then brackets": poisoned_line(1 << 20, b'"'),
    "object with such a string": poisoned_line(1 << 20),
    "brackets": b"[" * (1 << 20),
    "strings of escaped backslashes and quotes": mib_of(b'"\\\\\\"', b"[" * 65),
    "empty strings and brackets": mib_of(b'"",['),
    "quote, backslash, repeated": mib_of(b'"\\', b"[" * 65),
    "unclosed strings among brackets": mib_of(b'[{"a":"\\"'),
}


@pytest.mark.parametrize("shape", list(ADVERSARIAL_1MIB))
def test_a_1mib_adversarial_line_is_parsed_or_refused_in_linear_time(shape, tmp_path):
    data = ADVERSARIAL_1MIB[shape]
    assert len(data) == 1 << 20
    (tmp_path / "line").write_bytes(data)
    for kind in ("bytes", "str"):  # as requests come, and as lines of a file are read
        out = timed_child("from dml_app.wire import bounded_json\n"
                          "doc = open(path, 'rb').read()\n"
                          "doc = doc.decode('latin-1') if kind == 'str' else doc\n"
                          "t0 = time.perf_counter()\n"
                          "try:\n    bounded_json.loads(doc)\nexcept ValueError:\n    pass\n"
                          "out['s'] = time.perf_counter() - t0", path=str(tmp_path / "line"), kind=kind)
        assert out.get("s", 1e9) <= LOADS_BOUND_S, f"bounded_json.loads of 1 MiB ({shape}, {kind}) {took_s(out)}"


def test_viewing_a_stored_run_with_poisoned_events_does_not_hold_the_controller(make_controller, tmp_path):
    exp, served, _ = make_controller()
    assert os.path.realpath(exp.workdir) == os.path.realpath(tmp_path)
    stored_poisoned_run(tmp_path, poisoned=("n1",))  # one file: its line read twice a view
    with requests_attacker("127.0.0.1", served.port, raw_get("/api/runs/poisoned-run"), 1,
                           stop_after_slow_s=REFUSAL_BOUND_S) as attacker:
        attacker.wait_line("ready", 30)
        calls = root_statuses(served.url + "/status", 6.0, alive=attacker)
        attacker.leave(CURL_MAX_S + 15)
        results = json.loads(attacker.wait_line("results", 5))
    worst = max(r[0] for r in results)
    assert_root_answered(calls, what=f" while nobody viewed the poisoned run ({len(results)} calls, worst "
                                     f"{worst:.2f} s)")
    assert {r[1] for r in results} == {200}, results[:10]
    assert worst <= REFUSAL_BOUND_S, f"nobody's views took up to {worst:.2f} s: {sorted(r[0] for r in results)[-10:]}"


# --- 5, 6, 9: connections held idle or trickling ---------------------------------------------------

def test_a_thousand_idle_connections_do_not_hold_the_controller(make_controller):
    _, served, _ = make_controller()
    with hold([{"host": "127.0.0.1", "port": served.port, "count": 1000}], "idle") as attacker:
        ready = attacker.wait_json("ready", 40)
        assert ready["opened"] >= 100, ready  # the attack is in place
        calls = root_statuses(served.url + "/status", 8.0, alive=attacker)
        held = attacker.last("status")
    assert_root_answered(calls, what=f" while nobody held 1000 idle connections (ready {ready}, last {held})")


def test_trickled_request_heads_do_not_hold_the_controller_and_are_cut(make_controller, dummy_net):
    _, served, _ = make_controller()
    groups = [{"host": "127.0.0.1", "port": served.port, "count": 300},
              {"host": dummy_net.server, "port": served.port, "count": 300, "source": dummy_net.attacker}]
    with hold(groups, "trickle", STATUS_HEAD, interval=10.0) as attacker:
        ready = attacker.wait_json("ready", 40)
        assert ready["opened"] >= 100, ready
        # one more trickle, a byte a second: no read ever waits long, only a deadline for the whole head cuts it
        with hold([{"host": "127.0.0.1", "port": served.port, "count": 1}], "trickle", STATUS_HEAD, interval=1.0,
                  retry=1e9, report_closes=True) as probe:
            probe.wait_line("ready", 15)
            calls = root_statuses(served.url + "/status", 25.0, alive=attacker)
            try:
                lived: Optional[float] = float(probe.wait_line("closed", HEAD_DEADLINE_BOUND_S))
            except AssertionError:
                lived = None
            probe_status = probe.last("status")
        held = attacker.last("status")
    assert_root_answered(calls, what=f" while 600 connections trickled their heads (ready {ready}, last {held})")
    assert lived is not None and lived <= HEAD_DEADLINE_BOUND_S, (
        f"a request head trickled a byte a second was not cut within {HEAD_DEADLINE_BOUND_S} s "
        f"(closed after {lived} s; probe {probe_status})")


def test_one_address_cannot_take_every_place(make_controller, dummy_net):
    _, served, _ = make_controller()
    groups = [{"host": dummy_net.server, "port": served.port, "count": 300, "source": dummy_net.attacker}]
    with hold(groups, "trickle", STATUS_HEAD, interval=10.0) as attacker:
        ready = attacker.wait_json("ready", 40)
        assert ready["opened"] >= 100, ready
        url = f"http://{dummy_net.server}:{served.port}/status"
        calls = root_statuses(url, 10.0, interface=dummy_net.other, alive=attacker)
        held = attacker.last("status")
    worst = max(s for s, _ in calls)
    # not loopback: refused without the admin token, but answered
    assert all(code != 0 for _, code in calls) and worst <= ROOT_BOUND_S, (
        f"a caller from {dummy_net.other} while {dummy_net.attacker} trickled 300 heads: worst {worst:.2f} s, "
        f"calls (s, status) {calls}; attacker {ready} / {held}")


# --- 7, 8: readers of the event stream ----------------------------------------------------------------

def _stream_readers(served: Any) -> Attacker:
    return hold([{"host": "127.0.0.1", "port": served.port, "count": 300}], "stream", STREAM_HEAD)


def test_three_hundred_stream_readers_do_not_hold_the_controller(make_controller):
    _, served, _ = make_controller()
    with _stream_readers(served) as attacker:
        ready = attacker.wait_json("ready", 40)
        assert ready["opened"] >= 100, ready
        calls = root_statuses(served.url + "/status", 8.0, alive=attacker)
        held = attacker.last("status")
    assert_root_answered(calls, what=f" while nobody held 300 /api/stream readers (ready {ready}, last {held})")


def _root_stream_s(port: int, since: float, bound_s: float) -> tuple[Optional[float], bytes]:
    """Root's GET /api/stream: seconds from ``since`` to its first message (None: not within
    ``since + bound_s + 1``), and what came."""
    got = b""
    deadline = since + bound_s + 1.0
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=max(0.1, deadline - time.monotonic())) as s:
            s.sendall(STREAM_HEAD.encode())
            while b"retry:" not in got and b"data:" not in got:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, got
                s.settimeout(left)
                chunk = s.recv(4096)
                if not chunk:
                    return None, got
                got += chunk
    except OSError:
        return None, got
    return time.monotonic() - since, got


def test_stream_readers_that_leave_free_their_places_at_once(make_controller):
    _, served, _ = make_controller()
    attacker = _stream_readers(served)
    try:
        ready = attacker.wait_json("ready", 40)
        assert ready["opened"] >= 100 and ready["reading"] >= 1, ready
        attacker.wait_line("status", 5, after=len(attacker.lines))  # held a moment longer
        attacker.leave()
        left = attacker.wait_json("left", 1)
        since = time.monotonic()
        stream: dict[str, Any] = {}
        reader = threading.Thread(target=lambda: stream.update(result=_root_stream_s(served.port, since,
                                                                                     AFTER_LEAVE_BOUND_S)))
        reader.start()
        status = root_status_s(served.url + "/status")
        reader.join(AFTER_LEAVE_BOUND_S + 5)
    finally:
        attacker.kill()
    streamed, got = stream.get("result", (None, b""))
    assert status[1] == 200 and status[0] <= AFTER_LEAVE_BOUND_S, (
        f"root's /status right after 300 readers left ({left}): {status[0]:.2f} s, status {status[1]}")
    assert streamed is not None and streamed <= AFTER_LEAVE_BOUND_S and got.startswith(b"HTTP/1.1 200"), (
        f"root's /api/stream after the readers left: {streamed} s, got {got[:120]!r}")
