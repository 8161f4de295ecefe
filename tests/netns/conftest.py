"""Fixtures of the netns tier: a WorkerHost with its own testbed id, subnet and state dir,
always reset afterwards and checked for leftovers."""
from __future__ import annotations

import itertools
import json
import os
import secrets
import shutil
import time

import pytest

from worker.host import WorkerHost

_subnets = itertools.count(10)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/netns/" in str(item.fspath):
            item.add_marker(pytest.mark.netns)
            if os.geteuid() != 0:
                item.add_marker(pytest.mark.skip(reason="needs root: network namespaces, tc and cgroups"))


@pytest.fixture
def make_host(tmp_path):
    """Factory of WorkerHosts on their own testbed ids; every one is reset and checked at teardown."""
    hosts: list[WorkerHost] = []

    def make(testbed_id: str | None = None, subnet: str | None = None, state_dir: str | None = None) -> WorkerHost:
        tb = testbed_id or "t" + secrets.token_hex(2)
        net = subnet or f"10.{200 + next(_subnets) % 50}.0.0/16"
        host = WorkerHost(tb, net, state_root=state_dir or str(tmp_path / f"state-{tb}"))
        hosts.append(host)
        return host

    yield make
    for host in reversed(hosts):
        host.reset()
    for host in hosts:
        left = host.runtime.leftovers()
        assert not any(left.values()), f"testbed {host.testbed_id} left {left}"


@pytest.fixture
def host(make_host):
    return make_host()


def need_iperf3() -> None:
    if not shutil.which("iperf3"):
        pytest.skip("iperf3 not installed")


def links(*triples: tuple[str, str, str, int]) -> dict:
    """A set-links body from (src, dst, dst_ip, rate_bps) tuples."""
    return {"version": 1, "links": [{"src": s, "dst": d, "dst_ip": ip, "shape": {"rate_bps": r}}
                                    for s, d, ip, r in triples]}


def iperf_server(host: WorkerHost, node: str) -> str:
    """Start a persistent iperf3 server in ``node``; returns its process id."""
    return host.start_process(node, {"version": 1, "argv": ["iperf3", "-s"]})["id"]


def goodput_bps(host: WorkerHost, client: str, server_ip: str, seconds: int = 4, reverse: bool = False) -> float:
    """TCP goodput measured by iperf3 from ``client`` to ``server_ip`` (retries while the server starts)."""
    argv = ["iperf3", "-c", server_ip, "-t", str(seconds), "-O", "1", "-J"] + (["-R"] if reverse else [])
    for _ in range(50):
        out = host.exec(client, {"version": 1, "argv": argv, "timeout_s": seconds + 30})
        if out["returncode"] == 0:
            return json.loads(out["stdout"])["end"]["sum_received"]["bits_per_second"]
        time.sleep(0.1)
    raise AssertionError(f"iperf3 from {client} to {server_ip} failed: {out['stdout'][-500:]} {out['stderr'][-500:]}")
