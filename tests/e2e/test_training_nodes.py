"""A node that trains keeps serving, and trains on one busy thread, however it was started.

Two gossip nodes on a fast link: n1 trains for seconds each round, n2 for a moment, so n2's
models reach n1 while n1 trains. n1 must take them within their link time (its training runs
off its event loop), and no node process may have a second busy thread (a BLAS pool spinning
beside the training: numpy imported before one-thread settings applied). Netns nodes forked by
the zygote, netns nodes started with ``exec``, and Docker nodes.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dml_app.runtime.events import read_events
from tests.docker.conftest import DOCKER
from tests.e2e.harness import Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]

LINKS = {"n1": [{"dest": "n2", "bw": "50mbit"}], "n2": [{"dest": "n1", "bw": "50mbit"}]}
HEAVY_EPOCHS = 600  # n1: seconds of training per round on its digits shard
ROUNDS = 3
CLK_TCK = os.sysconf("SC_CLK_TCK")


def node_pids(netns_inode: int) -> list[int]:
    """The Python processes in the network namespace whose inode is ``netns_inode``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.stat(f"/proc/{entry}/ns/net").st_ino != netns_inode:
                continue
            with open(f"/proc/{entry}/comm") as f:
                if f.read().startswith("python"):
                    pids.append(int(entry))
        except OSError:
            continue
    return pids


def thread_cpu_s(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of ``pid``."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def netns_inode_of(r: Run, runtime: str, node: str) -> int:
    if runtime == "docker":
        import docker

        container = docker.from_env().containers.get(f"etb-{r.id}-{node}")
        return os.stat(f"/proc/{container.attrs['State']['Pid']}/ns/net").st_ino
    return os.stat(f"/run/netns/etb-{r.id}-{node}").st_ino


@pytest.mark.parametrize("runtime", ["zygote", "exec", pytest.param("docker", marks=DOCKER)])
def test_a_training_node_takes_models_and_spins_no_second_thread(run, runtime, monkeypatch):
    monkeypatch.setenv("EDGETB_ZYGOTE", "0" if runtime == "exec" else "1")
    structure = {"sync": ROUNDS, "wait_s": 1, "model": {"kind": "numpy", "hidden": [512]},
                 "node_list": [{"name": "n1", "epoch": HEAVY_EPOCHS}, {"name": "n2", "epoch": 1}]}
    r = run(structure=structure, links=LINKS, extra_args=("--runtime", "docker") if runtime == "docker" else ())
    r.wait_phase("ready", timeout_s=180)
    assert r.get("/start").ok
    r.wait_phase("running")
    inode = netns_inode_of(r, runtime, "n1")

    # n1's threads while it trains: its training thread busy, every other one (almost) idle
    deadline = time.monotonic() + 60
    while not (pids := node_pids(inode)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(pids) == 1, f"n1's processes: {pids}"
    time.sleep(2.0)  # past its set-up, into its first round's training
    before, t0 = thread_cpu_s(pids[0]), time.monotonic()
    time.sleep(3.0)
    after, window_s = thread_cpu_s(pids[0]), time.monotonic() - t0
    used = sorted(((after[t] - before.get(t, 0.0)) / window_s for t in after), reverse=True)
    assert used[0] > 0.5, f"n1 did not train in the window (threads' CPU shares: {used})"
    assert sum(used[1:]) < 0.15, f"n1's other threads are busy beside its training: {used}"

    done = r.wait_phase("finished", timeout_s=300)
    assert done["done"] == 2 and done["failed"] == 0, done
    summary = r.get("/finish").json()
    events = {p.stem: read_events(str(p)) for p in (Path(summary["run_dir"]) / "events").iterdir()}
    n1_rounds = [e for e in events["n1"] if e["type"] == "round"]
    n2_rounds = [e for e in events["n2"] if e["type"] == "round"]
    assert len(n1_rounds) == len(n2_rounds) == ROUNDS
    assert min(e["train_s"] for e in n1_rounds) > 2.0, "n1's training was too short to test anything"
    # n2 sends to n1 (its one peer) every round, while n1 trains: each send takes link time, not n1's training
    assert not [e for e in events["n2"] if e["type"] in ("send_failed", "peer_dropped")], events["n2"]
    assert max(e["send_s"] for e in n2_rounds) < 1.0, [e["send_s"] for e in n2_rounds]
    assert sum(e["received_models"] for e in n1_rounds) >= 1
