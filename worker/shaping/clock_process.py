"""A host's trace clock in a process of its own: no other thread holds the interpreter it ticks in.

In the agent's process a tick that is due has to take Python's interpreter lock back from the
agent's other threads (HTTP, telemetry, process records) after waking and after every system
call of its batches; on a host whose cores bulk flows keep busy, a thread of nice 0 holding it
may wait tens to hundreds of ms for a core while the real-time tick waits for it. Here the
``ScheduleClock`` runs in a child process (``python -m worker.shaping.clock_process``) that
does nothing else: its thread is real-time (``schedule.realtime``), the bins' messages are built
up front and frozen out of the garbage collector's walks.

The child reads one JSON command a line on stdin and answers each with one JSON line on stdout
(nothing but JSON, both ways; the schedule was checked by the agent and is checked again here):

- ``{"op": "start", "start": monotonic s, "links": [...], "nodes": {src: [netns, plan]}}``: a
  new clock, built whole before the running one is stopped; ``{"ok", "tick_s", "previous"}``;
- ``{"op": "end", "links": [[src, dst], ...]}``: no longer ticked; ``{"running", "ended"}``;
- ``{"op": "replan", "nodes": {src: [netns, plan or null]}}``: those links built again;
- ``{"op": "stop"}``: ``{"running", "applied": [[src, dst, bin], ...], "rows", "policy"}``.

A refusal is ``{"error": text, "kind": "ConfigError" | ...}``. At the end of stdin (the agent
ended) it stops ticking and exits; the kernel keeps each link's last bin.
"""
from __future__ import annotations

import gc
import math
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from typing import IO, Any, Optional

from worker.api.errors import ConfigError, ShapingError, TestbedError
from worker.shaping.schedule import LinkSchedule, ScheduleClock, check

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ANSWER_S = 30.0  # a command's answer (a start builds every bin's messages first)
START_S = 30.0  # the child's first line (its imports) on a loaded host
log = logging.getLogger("edgetb.schedule")


def link_json(link: LinkSchedule) -> dict[str, Any]:
    return {"src": link.src, "dst": link.dst, "rates_bps": list(link.rates_bps),
            "netem": [list(v) for v in link.netem] if link.netem is not None else None,
            "bin_ms": link.bin_ms, "loop": link.loop, "offset_s": link.offset_s}


def link_from(item: dict[str, Any]) -> LinkSchedule:
    netem = item.get("netem")
    return LinkSchedule(item["src"], item["dst"], tuple(item["rates_bps"]),
                        tuple((float(d), float(l)) for d, l in netem) if netem is not None else None,
                        int(item["bin_ms"]), bool(item["loop"]), float(item["offset_s"]))


def _finished(clock: ScheduleClock) -> dict[str, Any]:
    applied = clock.stop()
    return {"running": True, "applied": [[s, d, k] for (s, d), k in applied.items()],
            "rows": clock.rows_since(0), "policy": clock.policy}


def serve(inp: IO[str], out: IO[str]) -> int:
    """The child's loop: each command of ``inp`` answered on ``out`` (see the module's text)."""
    clock: Optional[ScheduleClock] = None

    def answer(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj, separators=(",", ":")) + "\n")
        out.flush()

    answer({"ready": True, "pid": os.getpid()})
    for line in inp:
        try:
            cmd = json.loads(line)
            op = cmd.get("op") if isinstance(cmd, dict) else None
            if op == "start":
                nodes = {src: (netns, plan) for src, (netns, plan) in cmd["nodes"].items()}
                links, start = [link_from(x) for x in cmd["links"]], float(cmd["start"])
                check(links)  # (the agent checked them: the child does not rely on it)
                if not math.isfinite(start):
                    raise ConfigError(f"schedule: start {start} is not a time")
                new = ScheduleClock(links, nodes, start)
                previous = _finished(clock) if clock is not None else None
                clock = new
                gc.collect()
                gc.freeze()  # the bins' lists are not walked again by later collections
                clock.begin()
                answer({"ok": True, "tick_s": clock.tick_s, "previous": previous})
            elif op == "end":
                ended = clock.end({(s, d) for s, d in cmd["links"]}) if clock is not None else []
                answer({"running": clock is not None, "ended": [list(k) for k in ended]})
            elif op == "replan":
                if clock is not None:
                    clock.replan({src: (netns, plan) for src, (netns, plan) in cmd["nodes"].items()})
                answer({"ok": True})
            elif op == "stop":
                answer(_finished(clock) if clock is not None else {"running": False})
                clock = None
                gc.unfreeze()
            else:
                answer({"error": f"unknown command {op!r}", "kind": "ConfigError"})
        except TestbedError as e:
            answer({"error": e.message, "kind": type(e).__name__})
        except (ValueError, KeyError, TypeError) as e:
            answer({"error": f"a malformed command: {type(e).__name__}: {e}", "kind": "ConfigError"})
    if clock is not None:  # the agent is gone
        clock.stop()
    return 0


class ClockProcess:
    """The agent's handle on its clock's child process (one command at a time)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "worker.shaping.clock_process"], cwd="/", env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buf = b""
        self._lock = threading.Lock()
        self._ready = False

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, cmd: dict[str, Any], timeout_s: float = ANSWER_S) -> dict[str, Any]:
        """Send ``cmd``; its answer (a refusal raised: ConfigError or ShapingError)."""
        with self._lock:
            if not self._ready:
                self._readline(START_S)
                self._ready = True
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps(cmd, separators=(",", ":")).encode() + b"\n")
            except OSError as e:
                raise ShapingError(f"the trace clock's process is gone ({e})") from None
            answer = json.loads(self._readline(timeout_s))
        if "error" in answer:
            raise (ConfigError if answer.get("kind") == "ConfigError" else ShapingError)(answer["error"])
        return answer

    def _readline(self, timeout_s: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ShapingError(f"the trace clock's process did not answer within {timeout_s:g} s")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    raise ShapingError(f"the trace clock's process ended (code {self.proc.wait()})")
                self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def close(self) -> None:
        """End the child (the end of its stdin; killed if it does not go within 5 s)."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trace clock %(levelname)s %(message)s")
    try:
        return serve(sys.stdin, sys.stdout)
    except BrokenPipeError:  # the agent ended before it read an answer: as at the end of stdin
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (no second error at exit)
        return 0


if __name__ == "__main__":
    sys.exit(main())
