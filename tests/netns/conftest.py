"""Fixtures and helpers of the netns tier.

Every test gets WorkerHosts on their own short testbed ids (``t`` + 4 random
characters), their own free /16 subnets (10.200-254.0.0/16, never the user's
10.77.0.0/16) and state dirs under ``tmp_path``. Teardown always resets every
host, even when the test failed, and then asserts that nothing carrying the
testbed id is left (namespaces, links, cgroups, iptables rules).
"""
from __future__ import annotations

import json
import os
import random
import secrets
import shutil
import string
import time
from typing import Any, Callable, Iterator, Optional

import pytest

from tests.subnets import free_subnets
from worker.host import WorkerHost

IPERF_PORT = 5201
_used_subnets: set[str] = set()


# skips ---------------------------------------------------------------------------------------
def _missing_tools(*tools: str) -> list[str]:
    return [t for t in tools if not shutil.which(t)]


def root_skip_reason() -> Optional[str]:
    """Why this tier cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "netns tier needs root (network namespaces, veth, tc, cgroups)"
    missing = _missing_tools("ip", "tc")
    if missing:
        return f"iproute2 not installed (missing {', '.join(missing)})"
    return None


# ``pytestmark = NETNS`` in every module of this tier
NETNS = [pytest.mark.netns, pytest.mark.skipif(root_skip_reason() is not None, reason=root_skip_reason() or "")]


def need_iperf3() -> None:
    if not shutil.which("iperf3"):
        pytest.skip("iperf3 not installed")


def need_tools(*tools: str) -> None:
    missing = _missing_tools(*tools)
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")


# testbed ids and subnets -----------------------------------------------------------------------
def new_testbed_id() -> str:
    return "t" + "".join(random.choice(string.ascii_lowercase + string.digits) for _ in range(4))


def free_subnet() -> str:
    """A random 10.2xx.0.0/16 that no interface of this host uses, preferring one this session has not
    handed out yet (a released one is taken once every other is used)."""
    free = free_subnets(random.sample(range(200, 255), 55))
    for subnet in sorted(free, key=lambda s: s in _used_subnets):  # unused ones first, then released ones
        _used_subnets.add(subnet)
        return subnet
    raise RuntimeError("no free 10.2xx.0.0/16 subnet on this host")


def assert_no_leftovers(host: WorkerHost) -> None:
    left = host.runtime.leftovers()
    assert set(left) >= {"netns", "links", "cgroups", "iptables"}, left
    for key, items in left.items():
        assert not items, f"testbed {host.testbed_id} left {key}: {items}"


def reset_hosts(hosts: list[WorkerHost], check: Callable[[WorkerHost], None]) -> None:
    """Reset every host (the others too when one fails), then ``check`` each left nothing."""
    errors = []
    for host in reversed(hosts):
        try:
            host.reset()
        except Exception as e:  # reset the others anyway, then fail
            errors.append(f"reset of {host.testbed_id} failed: {e!r}")
    assert not errors, errors
    for host in hosts:
        check(host)


def host_factory(tmp_path: Any, check: Callable[[WorkerHost], None],
                 runtime: Optional[str] = None) -> Iterator[Callable[..., WorkerHost]]:
    """What a tier's ``make_host`` fixture yields from: a factory of WorkerHosts of ``runtime``
    (default: netns), each on a new testbed id and free subnet with its state under ``tmp_path``
    (``**options``: the runtime's); at teardown every one is reset (even on failure) and ``check``ed."""
    hosts: list[WorkerHost] = []

    def make(testbed_id: Optional[str] = None, subnet: Optional[str] = None, state_dir: Optional[str] = None,
             **options: Any) -> WorkerHost:
        tb = testbed_id or new_testbed_id()
        host = WorkerHost(tb, subnet or free_subnet(),
                          state_root=state_dir or str(tmp_path / f"state-{tb}-{secrets.token_hex(2)}"),
                          runtime=runtime, runtime_options=options or None)
        hosts.append(host)
        return host

    yield make
    reset_hosts(hosts, check)


@pytest.fixture
def make_host(tmp_path) -> Iterator[Callable[..., WorkerHost]]:
    """Factory of netns WorkerHosts; every one is reset at teardown and checked for leftovers."""
    yield from host_factory(tmp_path, assert_no_leftovers)


@pytest.fixture
def host(make_host) -> WorkerHost:
    """One WorkerHost of the tier's ``make_host``."""
    return make_host()


# request bodies -------------------------------------------------------------------------------
def nodes_body(*nodes: Any) -> dict:
    """A create-nodes body from names or node dicts."""
    return {"version": 1, "nodes": [{"name": n} if isinstance(n, str) else n for n in nodes]}


def links(*quads: tuple[str, str, str, int]) -> dict:
    """A set-links body from (src, dst, dst_ip, rate_bps) tuples."""
    return {"version": 1, "links": [{"src": s, "dst": d, "dst_ip": ip, "shape": {"rate_bps": r}}
                                    for s, d, ip, r in quads]}


def gso_max_size(netns: str) -> int:
    """The kernel's gso_max_size of eth0 inside ``netns`` (netlink)."""
    from pyroute2 import NetNS

    with NetNS(netns) as ns:
        (link,) = ns.get_links(ifname="eth0")
        return link.get_attr("IFLA_GSO_MAX_SIZE")


def wait_for(predicate: Callable[[], Any], timeout_s: float = 15.0, what: str = "condition") -> None:
    """Poll ``predicate`` until it is true (AssertionError naming ``what`` after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s}s")
        time.sleep(0.05)


# traffic --------------------------------------------------------------------------------------
def wait_listening(host: WorkerHost, node: str, port: int = IPERF_PORT, timeout_s: float = 10.0) -> None:
    """Poll ``ss`` in the node until something listens on TCP ``port``."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = host.exec(node, {"version": 1, "argv": ["ss", "-Hltn", f"sport = :{port}"], "timeout_s": 5})
        if out["returncode"] == 0 and f":{port}" in out["stdout"]:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"nothing listens on port {port} in node {node} after {timeout_s}s: {out}")
        time.sleep(0.05)


def iperf_server(host: WorkerHost, node: str) -> str:
    """Start a persistent iperf3 server in ``node``, wait until it listens; returns its process id."""
    need_tools("ss")
    proc = host.start_process(node, {"version": 1, "argv": ["iperf3", "-s", "-p", str(IPERF_PORT)]})
    wait_listening(host, node)
    return proc["id"]


def iperf_json(text: str) -> dict:
    """The JSON document in iperf3 -J output (ignoring anything printed around it)."""
    start, end = text.find("{"), text.rfind("}")
    if start < 0 or end < start:
        raise AssertionError(f"no iperf3 JSON in: {text[-500:]!r}")
    return json.loads(text[start:end + 1])


def goodput_bps(host: WorkerHost, client: str, server_ip: str, seconds: int = 4, reverse: bool = False) -> float:
    """TCP goodput (bits/s received) measured by iperf3 from ``client`` to the server at ``server_ip``;
    with ``reverse`` the server sends. The first second (slow start) is omitted. A refused or busy
    server is retried a few times; a measured value is never retried."""
    argv = ["iperf3", "-c", server_ip, "-p", str(IPERF_PORT), "-t", str(seconds), "-O", "1", "-J"]
    argv += ["-R"] if reverse else []
    out: dict = {}
    for _ in range(10):
        out = host.exec(client, {"version": 1, "argv": argv, "timeout_s": seconds + 30})
        if out["returncode"] == 0:
            return float(iperf_json(out["stdout"])["end"]["sum_received"]["bits_per_second"])
        time.sleep(0.2)
    raise AssertionError(f"iperf3 from {client} to {server_ip} failed: {out.get('stdout', '')[-500:]} "
                         f"{out.get('stderr', '')[-500:]}")


def report(request: Any, name: str, value: float) -> None:
    """Keep a measured value in the test report (shown with ``-rA`` and in junit xml)."""
    request.node.user_properties.append((name, round(value, 4)))
    print(f"{request.node.name}: {name} = {value:.4f}")
