"""Benchmark of the swarm fabric end to end, as a user sees it: a gossip run over three Docker hosts.

Run as root: ``.venv/bin/python bench/bench_swarm.py [--per-host 2,8,16,32] [--max-ready-s 300] [--quick]
[--logs DIR]``. Prints a Markdown table on stdout (progress on stderr); ``--logs`` keeps each run
script's output and the agents' and engines' logs. It waits while the swarm test tier runs.

The three Docker hosts are host namespaces of this machine, each with its own dockerd holding the
node image and an agent on that engine (tests/swarm/engines.py); the controller's engine (this
namespace's) is the swarm manager. For each number of nodes per host, one real gossip experiment:
``gl_run.py --hosts hosts.json --nodes nodes.json`` in a copy of the default experiment
(tests/e2e/harness.py), every node with 3 links at 20 Mbit/s to nodes on other hosts, a short
gossip (5 rounds, 1 s waits, a small numpy model). Each step records: the user's wait from launching
the script to phase ``ready``; the controller's own "created N nodes in X s" and "ready in Y s"
(from its output); the time from ``/start`` to phase ``finished``; the rounds done and the mean
accuracy of the final status; the time the run's close takes (/emulated/reset, which removes the
nodes and leaves the swarm, then the script's exit; a failed reset fails the step); and what
is left afterwards on every engine and on this machine, which must be nothing. The steps go up
until one fails or its ready time passes ``--max-ready-s``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_netns import log, secs, table  # noqa: E402
from controller.workers.swarm import INIT_LABEL  # noqa: E402
from tests.e2e.harness import Run  # noqa: E402
from tests.swarm.engines import SwarmLan, root_api, root_swarm_state, save_image, sweep_stale, write_hosts_json  # noqa: E402
from worker.kernel import nsfs  # noqa: E402
from worker.nodes.docker import LABEL  # noqa: E402
from worker.nodes.docker_swarm import swarm_of  # noqa: E402

HOSTS = 3
LINKS_PER_NODE = 3
LINK_RATE = "20mbit"
OVERLAY = "10.80.0.0/20"
MTU = 1400
SYNC = 5
MODEL = {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0}
FINISH_TIMEOUT_S = 900.0
RESET_TIMEOUT_S = 600.0
EXIT_TIMEOUT_S = 120.0
TIER_POLL_S = 10.0
CREATED_RE = re.compile(r"created (\d+) nodes in ([\d.]+) s")
READY_RE = re.compile(r"ready in ([\d.]+) s")
STARTED_RE = re.compile(r"started (\d+) node processes in ([\d.]+) s")


class BenchError(Exception):
    """A step found something wrong (not a mere slow figure)."""


MAIN_PID = os.getpid()


def _on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM tears down as Ctrl-C does, in this process only: a forked helper (pyroute2's
    namespace servers are stopped with SIGTERM) dies, not running this teardown a second time."""
    if os.getpid() != MAIN_PID:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise KeyboardInterrupt


# the machine ----------------------------------------------------------------------------------
def swarm_tier_running() -> list[str]:
    """The command lines of running ``pytest ... tests/swarm`` processes (other than this one)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("pytest" in a for a in argv) and any("tests/swarm" in a for a in argv):
            found.append(f"{entry} {' '.join(argv).strip()}")
    return found


def wait_for_swarm_tier() -> None:
    """Block while the swarm test tier runs on this machine (it shares the root engine)."""
    said = False
    while running := swarm_tier_running():
        if not said:
            log(f"the swarm test tier is running ({running[0][:120]}): waiting for it to end")
            said = True
        time.sleep(TIER_POLL_S)
    if said:
        log("the swarm test tier has ended")


def mem_used_mib() -> int:
    """MemTotal - MemAvailable, in MiB."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0])
    return (fields["MemTotal"] - fields["MemAvailable"]) // 1024


def free_m() -> str:
    return subprocess.run(["free", "-m"], capture_output=True, text=True).stdout.rstrip()


def leave_root_swarm_if_ours(ids: list[str]) -> Optional[str]:
    """Leave (force) the root engine's swarm when one of the runs ``ids`` initialised it (its
    node label); what was done, or None."""
    api = root_api()
    try:
        if swarm_of(api.info())["state"] == "inactive":
            return None
        try:
            labels = {l for n in api.nodes() for l in [n.get("Spec", {}).get("Labels", {}).get(INIT_LABEL)] if l}
        except Exception:  # not a manager: not a swarm a run of ours made
            return None
        if labels & set(ids):
            api.leave_swarm(force=True)
            return f"the root engine was left in the swarm of run {sorted(labels & set(ids))}: left it"
        return None
    finally:
        api.close()


def leftovers(hosts: list[dict], testbed_id: str, swarm_before: str) -> list[str]:
    """What a run left: its containers and networks and a changed swarm state on the root engine,
    any container or swarm membership on every host's engine, its namespaces and links here."""
    left = []
    api = root_api()
    try:
        left += [f"root: container {c['Names'][0]}" for c in
                 api.containers(all=True, filters={"label": f"{LABEL}={testbed_id}"})]
        left += [f"root: network {n['Name']}" for n in api.networks(filters={"label": f"{LABEL}={testbed_id}"})]
        state = swarm_of(api.info())["state"]
        if state != swarm_before:
            left.append(f"root: swarm {state} (was {swarm_before})")
    finally:
        api.close()
    for host in hosts:
        engine = host["engine"].api()
        try:
            left += [f"{host['name']}: container {c['Names'][0]}" for c in engine.containers(all=True)]
            state = swarm_of(engine.info())["state"]
            if state != "inactive":
                left.append(f"{host['name']}: swarm {state}")
        finally:
            engine.close()
    left += [f"here: namespace {n}" for n in nsfs.list_netns() if n.startswith(f"etb-{testbed_id}-")]
    left += [f"here: link {name}" for _, name in socket.if_nameindex() if name.startswith(f"etb-{testbed_id}-")]
    return left


# the experiment -------------------------------------------------------------------------------
def experiment(per_host: int) -> tuple[dict[str, str], dict[str, list[dict]], dict]:
    """(placement, links, structure) of ``per_host`` nodes on each host: node k of host h links to
    node k and node k+1 of the next host and node k of the one after (all on other hosts)."""
    names = [[f"h{h}n{k}" for k in range(per_host)] for h in range(HOSTS)]
    placement = {n: f"h{h}" for h in range(HOSTS) for n in names[h]}
    links: dict[str, list[dict]] = {}
    for h in range(HOSTS):
        for k in range(per_host):
            dests = [names[(h + 1) % HOSTS][k], names[(h + 1) % HOSTS][(k + 1) % per_host], names[(h + 2) % HOSTS][k]]
            dests = list(dict.fromkeys(dests))[:LINKS_PER_NODE]
            links[names[h][k]] = [{"dest": d, "bw": LINK_RATE} for d in dests]
    structure = {"sync": SYNC, "epoch": 1, "wait_s": 1, "model": MODEL,
                 "node_list": [{"name": n} for n in placement]}
    return placement, links, structure


class Output:
    """The run script's output, read as it comes (a full pipe would stall the controller)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self.thread.start()

    def _read(self, proc: subprocess.Popen) -> None:
        try:
            for line in proc.stdout:
                self.lines.append(line)
        except (ValueError, OSError):  # closed under us
            pass

    def text(self) -> str:
        return "".join(self.lines)


def reset(r: Run) -> Optional[str]:
    """What ``Run.close`` does first, without its 30 s bound on the script's exit (a large swarm
    testbed takes longer to remove): /emulated/reset, then the script's exit. What went wrong, or None."""
    if r.proc is None or r.proc.poll() is not None:
        return None
    problem = None
    try:
        resp = requests.post(r.url + "/emulated/reset", timeout=RESET_TIMEOUT_S)
        if resp.status_code != 200:
            try:
                said = resp.json().get("message") or resp.text
            except ValueError:
                said = resp.text
            problem = f"/emulated/reset answered {resp.status_code}: {said[:1000]}"
    except requests.RequestException as e:
        problem = f"/emulated/reset: {e}"
    try:
        r.proc.wait(timeout=EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        problem = (problem or "") + f"; the run script did not exit within {EXIT_TIMEOUT_S:g} s of the reset"
    return problem


def step(lan: SwarmLan, tmp: Path, per_host: int, max_ready_s: float, ids: list[str],
         logs: Optional[Path] = None) -> dict[str, Any]:
    """One gossip run of ``per_host`` nodes on each host; its figures (``error`` when it failed).
    ``logs``: a directory to keep the run script's output in."""
    placement, links, structure = experiment(per_host)
    hosts = lan.hosts
    wait_for_swarm_tier()
    swarm_before = root_swarm_state()
    row: dict[str, Any] = {"per_host": per_host, "nodes": len(placement), "links": sum(map(len, links.values()))}
    r = Run(tmp, structure=structure, links=links, kind="gl", defer=True)
    ids.append(r.id)
    write_hosts_json(r.workdir / "hosts.json", lan, hosts, overlay_subnet=OVERLAY, overlay_mtu=MTU)
    (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [{"name": n, "host": h} for n, h in placement.items()]}))
    row["mem_before_mib"] = mem_used_mib()
    log(f"{per_host} per host: {row['nodes']} nodes, {row['links']} links across hosts (run {r.id}); "
        f"root swarm {swarm_before}, {row['mem_before_mib']} MiB used")
    out: Optional[Output] = None
    try:
        t0 = time.monotonic()
        r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
        out = Output(r.proc)
        try:
            ready = r.wait_phase("ready", "failed", timeout_s=max_ready_s * 1.5)
        except AssertionError as e:
            raise BenchError(f"not ready: {str(e)[:300]}\n{out.text()[-2000:]}") from None
        row["ready_s"] = time.monotonic() - t0
        if ready["phase"] != "ready":
            raise BenchError(f"phase {ready['phase']}: {ready.get('error')}\n{out.text()[-2000:]}")
        row["mem_ready_mib"] = mem_used_mib()
        log(f"ready in {row['ready_s']:.1f} s; {row['mem_ready_mib']} MiB used")
        if per_host >= 16:
            log("free -m at ready:\n" + free_m())
        t1 = time.monotonic()
        phase = r.get("/start").json()["phase"]
        if phase != "running":
            raise BenchError(f"/start answered phase {phase}")
        try:
            status = r.wait_phase("finished", "failed", timeout_s=FINISH_TIMEOUT_S)
        except AssertionError as e:
            raise BenchError(f"not finished: {str(e)[:300]}") from None
        row["run_s"] = time.monotonic() - t1
        nodes = status["nodes"]
        row["rounds"] = [n["round"] for n in nodes]
        accs = [n["accuracy"] for n in nodes if n["accuracy"] is not None]
        row["accuracy"] = statistics.mean(accs) if accs else None
        row["done"], row["failed"] = status["done"], status["failed"]
        log(f"{status['phase']} in {row['run_s']:.1f} s: {status['done']} done, {status['failed']} failed, "
            f"rounds {min(row['rounds'])}-{max(row['rounds'])}, mean accuracy {secs(row['accuracy'], 3)}")
        if status["phase"] != "finished" or status["failed"]:
            raise BenchError(f"phase {status['phase']}, {status['failed']} nodes failed: {status.get('error')}")
    except BenchError as e:
        row["error"] = str(e)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        t2 = time.monotonic()
        reset_error = reset(r)
        if reset_error:
            row.setdefault("error", reset_error)
        try:
            tail = r.close()
        except AssertionError as e:  # namespaces left: reported below as leftovers as well
            tail = ""
            row.setdefault("error", f"close: {e}")
        row["close_s"] = time.monotonic() - t2
        if out is not None:
            out.thread.join(timeout=10)
        text = (out.text() if out else "") + (tail or "")
        if m := CREATED_RE.search(text):
            row["created_s"] = float(m.group(2))
            if int(m.group(1)) != row["nodes"]:
                row.setdefault("error", f"the controller created {m.group(1)} nodes, not {row['nodes']}")
        if m := READY_RE.search(text):
            row["deploy_s"] = float(m.group(1))
        if m := STARTED_RE.search(text):
            row["processes_s"] = float(m.group(2))
        if logs is not None:
            (logs / f"run-{per_host}-per-host-{r.id}.log").write_text(text)
        for line in text.splitlines():
            if CREATED_RE.search(line) or READY_RE.search(line) or STARTED_RE.search(line):
                log(f"controller: {line.strip()}")
        row["left"] = leftovers(hosts, r.id, swarm_before)
        row["mem_after_mib"] = mem_used_mib()
        log(f"closed in {row['close_s']:.1f} s; leftovers: {row['left'] or 'none'}; {row['mem_after_mib']} MiB used")
        if "error" in row:
            log(f"FAILED: {row['error'][:1500]}")
        shutil.rmtree(r.workdir, ignore_errors=True)
    return row


def row_cells(row: dict[str, Any], max_ready_s: float) -> list[Any]:
    rounds = row.get("rounds")
    rounds_text = "-" if not rounds else (f"{min(rounds)}" if min(rounds) == max(rounds) else f"{min(rounds)}-{max(rounds)}")
    mem = (f"{row['mem_ready_mib'] - row['mem_before_mib']}" if "mem_ready_mib" in row else "-")
    note = "ok"
    if "error" in row:
        note = "FAILED: " + row["error"].splitlines()[0][:200]
    elif row.get("left"):
        note = f"LEFTOVERS: {len(row['left'])}"
    elif row.get("ready_s", 0) > max_ready_s:
        note = f"ready > {max_ready_s:g} s: stopped here"
    return [f"{HOSTS} × {row['per_host']}", row["nodes"], row["links"], secs(row.get("ready_s"), 1),
            secs(row.get("created_s"), 1), secs(row.get("deploy_s"), 1), secs(row.get("processes_s"), 1),
            secs(row.get("run_s"), 1), f"{rounds_text} / {SYNC}", secs(row.get("accuracy"), 3),
            secs(row.get("close_s"), 1), mem, "none" if not row.get("left") else "; ".join(row["left"][:5]), note]


HEADERS = ["hosts × nodes", "nodes", "links", "launch → ready (s)", "controller: created (s)",
           "controller: deployed, ready (s)", "node processes started (s)", "/start → finished (s)", "rounds",
           "mean accuracy", "close: reset, script exit (s)", "memory at ready (MiB over idle)", "leftovers", "outcome"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--per-host", default="2,8,16,32", help="nodes per host, ascending (default 2,8,16,32)")
    p.add_argument("--max-ready-s", type=float, default=300.0, help="stop going up after a step slower to be ready")
    p.add_argument("--quick", action="store_true", help="2 per host only")
    p.add_argument("--logs", type=Path, help="keep each run script's output in this directory")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    per_host = [2] if args.quick else [int(x) for x in args.per_host.split(",") if x.strip()]
    if not per_host or any(n < 1 for n in per_host):
        print(f"--per-host: expected positive numbers, got {args.per_host!r}", file=sys.stderr)
        return 2
    if args.logs is not None:
        args.logs.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _on_sigterm)
    from worker.nodes import docker as runtime_docker

    wait_for_swarm_tier()
    swept = sweep_stale()
    if swept:
        log(f"swept the engines of dead runs: {swept}")
    tmp = Path(tempfile.mkdtemp(prefix="edgetb-bench-swarm-"))
    rows: list[dict[str, Any]] = []
    ids: list[str] = []
    failed = False
    lan: Optional[SwarmLan] = None
    infra: dict[str, float] = {}
    try:
        image = runtime_docker.node_image()
        api = root_api()
        try:
            t0 = time.monotonic()
            image_id = api.inspect_image(image)["Id"]
            tar = save_image(api, image, tmp / "node-image.tar")
            infra["image_save"] = time.monotonic() - t0
        finally:
            api.close()
        log(f"saved {image} ({tar.stat().st_size >> 20} MiB) in {infra['image_save']:.1f} s")
        (tmp / "lan").mkdir()
        lan = SwarmLan(tmp / "lan")
        lan.add_docker_hosts(HOSTS, tar, image_id)
        infra.update(lan.timings_s)
        log(f"{HOSTS} Docker hosts: agents {infra['agents']:.1f} s, engines {infra['engines_start']:.1f} s, "
            f"image load {infra['image_load']:.1f} s; {mem_used_mib()} MiB used\n{free_m()}")
        for n in per_host:
            row = step(lan, tmp, n, args.max_ready_s, ids, args.logs)
            rows.append(row)
            if "error" in row or row["left"]:
                failed = True
                break
            if row["ready_s"] > args.max_ready_s:
                log(f"ready took {row['ready_s']:.0f} s > {args.max_ready_s:g} s: not going higher")
                break
        if len(rows) < len(per_host):
            log(f"not run: {per_host[len(rows):]} per host")
    except KeyboardInterrupt:
        log("interrupted: tearing down")
        failed = True
    finally:
        if lan is not None and args.logs is not None:
            for path in sorted(lan.tmp.glob("*.log")):  # the agents' and the engines' logs
                shutil.copy(path, args.logs / path.name)
        if lan is not None:
            t0 = time.monotonic()
            left = lan.close()
            infra["lan_close"] = time.monotonic() - t0
            if left:
                failed = True
                log(f"LEFTOVERS of the Docker hosts: {left}")
        try:
            done = leave_root_swarm_if_ours(ids)
            if done:
                failed = True
                log(f"LEFTOVER: {done}")
        except Exception as e:
            failed = True
            log(f"cannot check the root engine's swarm: {e}")
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(HEADERS, [row_cells(r, args.max_ready_s) for r in rows]))
    print()
    print(f"Infrastructure ({HOSTS} Docker hosts): image saved in {secs(infra.get('image_save'), 1)} s, agents "
          f"{secs(infra.get('agents'), 1)} s, engines started in {secs(infra.get('engines_start'), 1)} s, image loaded "
          f"in {secs(infra.get('image_load'), 1)} s, torn down in {secs(infra.get('lan_close'), 1)} s.")
    skipped = per_host[len(rows):]
    if skipped:
        print(f"Not run: {', '.join(map(str, skipped))} per host.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
