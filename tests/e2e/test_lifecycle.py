"""A testbed id has one owner: a second run is refused and harms nothing; what a killed run
leaves (namespaces, veths, bridge, iptables rule, cgroups, node processes) is found and removed
by ``edgetb down`` or by the next run; SIGHUP cleans up; status reports what the kernel holds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT, Run
from tests.netns.conftest import free_subnet
from worker.kernel.procs import start_ticks

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

LINKS = {"n1": [{"dest": "n2", "bw": "20mbit"}, {"dest": "n3", "bw": "20mbit"}],
         "n2": [{"dest": "n3", "bw": "20mbit"}, {"dest": "n1", "bw": "20mbit"}],
         "n3": [{"dest": "n1", "bw": "20mbit"}, {"dest": "n2", "bw": "20mbit"}]}
NODES = {"nodes": [{"name": n, "mem": "512M"} for n in LINKS]}  # limits, so that there are cgroups to leave


def structure(sync: int) -> dict:
    return {"sync": sync, "wait_s": 1, "model": {"kind": "numpy", "hidden": [32], "learning_rate": 0.005, "seed": 0},
            "node_list": [{"name": n, "epoch": 1} for n in LINKS]}


def make_run(tmp_path: Path, sync: int = 4, like: Run | None = None, start: bool = True, *args: str) -> Run:
    """A 3-node gossip run with cgroup limits; ``like``: on the same testbed id, subnet and state dir."""
    r = Run(tmp_path, structure=structure(sync), links=LINKS, defer=True)
    (r.workdir / "nodes.json").write_text(json.dumps(NODES))
    r.subnet = free_subnet()  # one no interface of this host holds (other runs may be up)
    if like is not None:
        r.id, r.subnet, r.state = like.id, like.subnet, like.state
    if start:
        r.start("--nodes", "nodes.json", *args)
    return r


@pytest.fixture
def runs():
    made: list[Run] = []
    yield made
    for r in made:
        if r.proc is not None and r.proc.poll() is None:
            r.close()
    for r in made:  # whatever a test left: removed, and the test fails below if it had to be
        edgetb(r, "down", check=False)


def edgetb(r: Run, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("EDGETB_SUBNET",)}
    env.update(EDGETB_ID=r.id, EDGETB_STATE_DIR=str(r.state))
    done = subprocess.run([sys.executable, "-m", "controller", *args], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"edgetb {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


def leftovers(r: Run, pids: list[int]) -> dict[str, list]:
    """Everything of the testbed on this host: namespaces, links, cgroups, iptables rules, node processes."""
    from worker.nodes.netns import NetnsRuntime
    from worker.state import StateStore

    left: dict[str, list] = NetnsRuntime(StateStore(r.id, str(r.state)), r.subnet).leftovers()
    left["processes"] = [pid for pid in pids if start_ticks(pid) is not None]
    return left


def node_pids(r: Run) -> list[int]:
    return [n["pid"] for n in r.get("/status").json()["nodes"]]


def assert_all_there(r: Run, pids: list[int], nodes_alive: bool = True) -> None:
    """The testbed is whole; its node processes run (or, after their starter's kill -9, died with it)."""
    deadline = time.monotonic() + 5
    while (left := leftovers(r, pids))["processes"] and not nodes_alive and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(left["netns"]) == 3 and f"etb-{r.id}-br" in left["links"] and len(left["links"]) == 4, left
    assert left["iptables"] and left["cgroups"] and len(left["processes"]) == (3 if nodes_alive else 0), left


def assert_nothing_left(r: Run, pids: list[int]) -> None:
    deadline = time.monotonic() + 5  # SIGKILLed processes take a moment to be reaped
    while (left := leftovers(r, pids))["processes"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(left.values()), left
    assert not (r.state / r.id / "owner.json").exists()


def kill_9(r: Run) -> str:
    r.proc.send_signal(signal.SIGKILL)
    r.proc.wait(timeout=10)
    return r.proc.stdout.read()


def refused(r: Run, timeout_s: float) -> str:
    """Start ``r`` (--auto) while another run holds what it needs: it must exit 2; its output."""
    r.start("--nodes", "nodes.json", "--auto")
    out, _ = r.proc.communicate(timeout=timeout_s)
    assert r.proc.returncode == 2, out
    return out


def test_a_second_run_is_refused_and_the_first_finishes(tmp_path, runs):
    first = make_run(tmp_path, sync=4)
    runs.append(first)
    ready = first.wait_phase("ready")
    pids = [n["pid"] for n in ready["nodes"]]

    second = make_run(tmp_path, like=first, start=False)
    runs.append(second)
    out = refused(second, timeout_s=60)
    assert f"testbed {first.id} is in use by pid {first.proc.pid} (gl_run.py" in out, out
    assert f"run {ready['run_id']}, since 20" in out and "nothing was changed" in out, out
    assert "removing" not in out, out
    down = edgetb(first, "down", check=False)
    assert down.returncode == 2 and f"in use by pid {first.proc.pid} (gl_run.py" in down.stderr, down.stderr
    assert f"curl localhost:{first.port}/emulated/reset" in down.stderr

    assert_all_there(first, pids)  # unharmed
    assert first.get("/status").json()["phase"] == "ready"
    assert first.get("/start").json()["phase"] == "running"
    done = first.wait_phase("finished", timeout_s=150)
    assert done["done"] == 3 and done["failed"] == 0
    first.close()
    assert_nothing_left(first, pids)


def test_a_second_testbed_in_the_same_directory_is_refused_and_the_first_finishes(tmp_path, runs):
    """Another testbed id in the same experiment directory would rewrite the shards and confs
    and take dml_file/node/<name>/ for its own uids (the first run's nodes then fail with
    PermissionError): it is refused, naming the first testbed and how to take it down."""
    first = make_run(tmp_path, sync=4)
    runs.append(first)
    ready = first.wait_phase("ready")
    pids = [n["pid"] for n in ready["nodes"]]
    shards = {p: p.stat().st_mtime_ns for p in (first.workdir / "dataset").rglob("*") if p.is_file()}
    assert shards

    second = make_run(tmp_path, start=False)  # its own id, subnet and port
    second.workdir, second.state = first.workdir, first.state
    runs.append(second)
    out = refused(second, timeout_s=120)
    assert f"experiment directory {first.workdir} is in use by testbed {first.id} (pid {first.proc.pid}" in out, out
    assert f"curl localhost:{first.port}/emulated/reset" in out and "nothing was changed" in out, out
    assert not [line for line in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
                .splitlines() if line.startswith(f"etb-{second.id}-")]
    assert {p: p.stat().st_mtime_ns for p in shards} == shards  # the first run's shards untouched

    assert_all_there(first, pids)
    assert first.get("/start").json()["phase"] == "running"
    done = first.wait_phase("finished", timeout_s=150)
    assert done["done"] == 3 and done["failed"] == 0, done["nodes"]
    first.close()
    assert_nothing_left(first, pids)
    again = make_run(tmp_path, start=False)  # the directory is free again once the first is gone
    again.workdir, again.state = first.workdir, first.state
    runs.append(again)
    again.start("--nodes", "nodes.json", "--auto")
    out, _ = again.proc.communicate(timeout=240)
    assert again.proc.returncode == 0, out


def test_kill_9_then_edgetb_down_removes_everything(tmp_path, runs):
    r = make_run(tmp_path, sync=200)
    runs.append(r)
    r.wait_phase("ready")
    assert r.get("/start").json()["phase"] == "running"
    r.wait_phase("running")
    pids = node_pids(r)
    kill_9(r)
    assert_all_there(r, pids, nodes_alive=False)  # the crash left the network; the nodes died with it

    status = json.loads(edgetb(r, "status", "--json").stdout)
    assert status["owner"]["state"] == "stale" and status["owner"]["holder"]["pid"] == r.proc.pid

    down = edgetb(r, "down")
    assert f"testbed {r.id} was left by pid {r.proc.pid} (gl_run.py" in down.stderr, down.stderr
    assert "which is gone: removing its namespaces, links and node processes" in down.stderr
    assert_nothing_left(r, pids)


def test_kill_9_then_a_new_run_cleans_up_and_completes(tmp_path, runs):
    dead = make_run(tmp_path, sync=200)
    runs.append(dead)
    ready = dead.wait_phase("ready")
    assert dead.get("/start").json()["phase"] == "running"
    pids = node_pids(dead)
    kill_9(dead)
    assert_all_there(dead, pids, nodes_alive=False)

    new = make_run(tmp_path, sync=3, like=dead, start=False)
    runs.append(new)
    new.start("--nodes", "nodes.json", "--auto")
    out, _ = new.proc.communicate(timeout=300)
    assert f"testbed {dead.id} was left by pid {dead.proc.pid} (gl_run.py" in out, out
    assert f"run {ready['run_id']}" in out and "removing its namespaces, links and node processes" in out, out
    assert new.proc.returncode == 0, out
    assert "removing the nodes and links" in out
    assert_nothing_left(new, pids)


def test_sighup_cleans_up(tmp_path, runs):
    r = make_run(tmp_path, sync=200)
    runs.append(r)
    r.wait_phase("ready")
    assert r.get("/start").json()["phase"] == "running"
    pids = node_pids(r)
    assert_all_there(r, pids)
    r.proc.send_signal(signal.SIGHUP)
    out, _ = r.proc.communicate(timeout=60)
    assert r.proc.returncode == 130, out
    assert "interrupted (SIGHUP)" in out and "removing the nodes and links" in out, out
    assert_nothing_left(r, pids)


def test_a_run_does_not_touch_a_testbed_brought_up_by_edgetb_up(tmp_path, runs):
    r = make_run(tmp_path, start=False)
    runs.append(r)
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    edgetb(r, "--subnet", r.subnet, "up", str(tmp_path / "links.json"))
    r.start("--nodes", "nodes.json", "--auto")
    out, _ = r.proc.communicate(timeout=60)
    assert r.proc.returncode == 2 and f"testbed {r.id} is already up: brought up by pid" in out, out
    assert "removing" not in out
    status = json.loads(edgetb(r, "status", "--json").stdout)
    assert len(status["nodes"]) == 3 and status["owner"]["state"] == "kept"
    edgetb(r, "down")
    assert_nothing_left(r, [])


def test_status_reports_the_bridge_address_the_kernel_holds(tmp_path, runs):
    r = make_run(tmp_path, start=False)
    runs.append(r)
    (tmp_path / "links.json").write_text(json.dumps(LINKS))
    edgetb(r, "--subnet", r.subnet, "up", str(tmp_path / "links.json"))
    status = json.loads(edgetb(r, "status", "--json").stdout)  # no --subnet: the default one is not this
    bridge_ip = r.subnet.replace("0.0/16", "0.1")
    assert status["subnet"] == r.subnet and status["bridge_ip"] == bridge_ip, status
    held = subprocess.run(["ip", "-4", "-br", "addr", "show", f"etb-{r.id}-br"], capture_output=True, text=True)
    assert f"{bridge_ip}/16" in held.stdout
    assert bridge_ip in edgetb(r, "status").stdout
    edgetb(r, "down")
    assert_nothing_left(r, [])


def test_a_failed_reset_is_an_error_and_the_controller_stays_for_a_retry(tmp_path, runs):
    from tests.e2e.lan import Lan
    from worker.kernel import nsfs

    lan = Lan(tmp_path)
    try:
        host = lan.add_host("netns", f"10.{lan.octet}.16.0/20")
        r = Run(tmp_path, structure=structure(3), links=LINKS, defer=True)
        runs.append(r)
        (r.workdir / "hosts.json").write_text(json.dumps({"version": 1, "controller_ip": lan.ip(None), "hosts": [
            {"name": "h0", "agent": host["url"], "runtime": "netns", "token_file": str(host["token_file"]),
             "tls_fingerprint": host["fingerprint"]}]}))
        (r.workdir / "nodes.json").write_text(json.dumps({"nodes": [{"name": n, "host": "h0"} for n in LINKS]}))
        r.start("--hosts", "hosts.json", "--nodes", "nodes.json")
        r.wait_phase("ready", timeout_s=120)

        agent_argv = host["proc"].args
        host["proc"].terminate()  # the agent goes away: its host cannot be reset
        host["proc"].wait(timeout=10)
        failed = r.get("/emulated/reset")
        assert failed.status_code >= 400 and "h0" in failed.json()["message"], failed.text
        time.sleep(1)
        assert r.proc.poll() is None and r.get("/status").ok  # still serving: the user can retry

        fd = os.open(nsfs.netns_path(host["netns"]), os.O_RDONLY)
        try:  # the agent is back (its state is on disk): the retry removes the nodes
            host["proc"] = subprocess.Popen(agent_argv, env=dict(os.environ, EDGETB_STATE_DIR=str(host["state"]),
                                                                 PYTHONPATH=str(ROOT)),
                                            cwd=str(ROOT), stdout=host["log"], stderr=subprocess.STDOUT,
                                            preexec_fn=lambda: nsfs.setns_fd(fd), start_new_session=True)
        finally:
            os.close(fd)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if __import__("requests").get(host["url"] + "/health", timeout=1).ok:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        retry = r.get("/emulated/reset")
        assert retry.status_code == 200, retry.text
        r.proc.wait(timeout=30)
        assert [n for n in nsfs.list_netns() if n.startswith(f"etb-{host['id']}-")] == []
    finally:
        left = lan.close()
        assert not left, left
