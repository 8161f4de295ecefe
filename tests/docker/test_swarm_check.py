"""``edgetb swarm check`` against this machine's engine, through a real agent over pinned HTTPS.

The check is read-only: the engine's swarm state (whatever it is) is the same afterwards.
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import subprocess
import sys
import time

import pytest

from controller import cli
from controller import swarm_check as sc
from controller.workers.agent_client import AgentClient
from tests.docker.conftest import DOCKER
from tests.e2e.harness import free_port
from tests.netns.conftest import free_subnet, new_testbed_id
from worker.nodes.docker_swarm import swarm_of

pytestmark = DOCKER
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lan_address() -> tuple[str, str]:
    """This machine's source address on its default route, and that interface."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        default = [r for r in ipr.get_routes(family=socket.AF_INET, table=254) if r["dst_len"] == 0]
        if not default:
            pytest.skip("no default route: no LAN address to act as controller_ip")
        index = default[0].get_attr("RTA_OIF")
        ifname = ipr.get_links(index)[0].get_attr("IFLA_IFNAME")
        addr = [a.get_attr("IFA_ADDRESS") for a in ipr.get_addr(family=socket.AF_INET, index=index)]
    return addr[0], ifname


@pytest.fixture
def agent(tmp_path):
    """An agent on loopback over HTTPS, its certificate's fingerprint and its token file."""
    state = tmp_path / "state"
    token_file = tmp_path / "h0.token"
    token_file.write_text(secrets.token_hex(16) + "\n")
    token_file.chmod(0o600)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "EDGETB_TOKEN"} | {"EDGETB_STATE_DIR": str(state)}
    argv = [sys.executable, "-m", "worker.agent", "--port", str(port), "--listen", "127.0.0.1", "--id",
            new_testbed_id(), "--subnet", free_subnet(), "--runtime", "docker", "--token-file", str(token_file)]
    done = subprocess.run([*argv, "--print-fingerprint"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log_path = tmp_path / "agent.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "agent listening" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-2000:]
            time.sleep(0.05)
        yield f"https://127.0.0.1:{port}", done.stdout.strip(), str(token_file)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _hosts_file(tmp_path, agent, **fields) -> str:
    url, fingerprint, token_file = agent
    path = tmp_path / f"hosts-{secrets.token_hex(2)}.json"
    path.write_text(json.dumps({"version": 1, "engine": "swarm", **fields, "hosts": [
        {"name": "h0", "agent": url, "runtime": "docker", "tls_fingerprint": fingerprint, "token_file": token_file}]}))
    return str(path)


def _free_overlay(taken: list[str]) -> str:
    for third in range(0, 256, 16):
        candidate = ipaddress.IPv4Network(f"10.{200 + third // 64}.{third}.0/20")
        if not sc.overlaps(candidate, taken):
            return str(candidate)
    pytest.skip("no free /20 for the overlay")


def test_swarm_check_reports_this_machines_real_facts_and_changes_nothing(tmp_path, agent, engine, capsys):
    controller_ip, ifname = _lan_address()
    mtu = int(open(f"/sys/class/net/{ifname}/mtu").read())
    before = swarm_of(engine.info())
    url, fingerprint, token_file = agent
    client = AgentClient(url, open(token_file).read().strip(), name="h0", fingerprint=fingerprint, timeout_s=60)
    facts = client.swarm_probe({"version": 1, "manager": controller_ip, "peers": [], "overlay_mtu": mtu - 50})

    # the agent's facts are this machine's: the engine, the kernel, the route towards the controller
    assert facts["engine"]["version"] == engine.version()["Version"]
    assert facts["engine"]["swarm"]["state"] in ("inactive", "active", "pending", "error", "locked")
    if os.path.isdir("/sys/module/vxlan"):
        assert facts["kernel"]["modules"]["vxlan"] == {"state": "available", "source": "/sys/module/vxlan"}
    ipvs = os.path.exists("/proc/net/ip_vs") or os.path.isdir("/sys/module/ip_vs")
    assert (facts["kernel"]["modules"]["ip_vs"]["state"] == "available") == ipvs
    assert facts["underlay"] == {"dst": controller_ip, "ifname": ifname, "mtu": mtu, "problem": None}
    with socket.socket() as s:
        s.settimeout(2)
        listening = s.connect_ex((controller_ip, 2377)) == 0
    assert facts["tcp"][0]["address"] == controller_ip and facts["tcp"][0]["port"] == 2377
    assert facts["tcp"][0]["open"] == listening
    nets = facts["networks"]
    assert str(ipaddress.IPv4Interface(f"{controller_ip}/{_prefix(controller_ip)}").network) in nets

    # the whole check, as the CLI runs it, with an overlay MTU the underlay carries and a free subnet
    overlay = _free_overlay(nets + facts["routes"])
    good = _hosts_file(tmp_path, agent, controller_ip=controller_ip, overlay_mtu=mtu - 50, overlay_subnet=overlay)
    code = cli.main(["swarm", "check", "--hosts", good, "--nodes", "3"])
    out = capsys.readouterr().out
    rows = _table(out)
    for host in ("controller", "h0"):
        assert rows[(host, "engine")] == "ok" and rows[(host, "vxlan")] == "ok", out
        assert rows[(host, "underlay mtu")] == "ok", out
        assert rows[(host, "ip_vs")] == ("ok" if ipvs else "warn"), out
    assert f"Docker {engine.version()['Version']}" in out
    assert f"{ifname} mtu {mtu} towards {controller_ip}" in out
    assert "udp: open 4789/udp and 7946/udp in the firewall" in out
    checked = sc.check(good, "3")
    judged = {(r.host, r.check): r for r in checked}
    if before["state"] in ("inactive", "active"):  # the agent's engine is the controller's: never another swarm
        assert judged[("h0", "swarm")].status == sc.OK, judged[("h0", "swarm")]
    assert judged[("hosts file", "overlay size")].detail == f"{overlay}: room for 4029 nodes, 3 needed"
    wanted = sc.OK if listening else sc.FAIL if (before["state"], before["manager"]) == ("active", True) else sc.WARN
    assert judged[("h0", f"tcp {controller_ip}:2377/tcp")].status == wanted
    assert code == sc.exit_code(checked)

    # the LAN's own network as the overlay: refused with the hosts file's reason, exit 2
    lan = str(ipaddress.IPv4Interface(f"{controller_ip}/{_prefix(controller_ip)}").network)
    bad = _hosts_file(tmp_path, agent, controller_ip=controller_ip, overlay_subnet=lan)
    assert cli.main(["swarm", "check", "--hosts", bad]) == 2
    assert f"overlay_subnet {lan} holds controller_ip {controller_ip}" in capsys.readouterr().err
    # an overlay 1 byte too large for the underlay, encrypted, for too many nodes: exit 2
    bad = _hosts_file(tmp_path, agent, controller_ip=controller_ip, overlay_mtu=mtu - 49, overlay_subnet=overlay,
                      overlay_encrypted=True)
    assert cli.main(["swarm", "check", "--hosts", bad, "--nodes", "100000"]) == 2
    out = capsys.readouterr().out
    judged = {(r.host, r.check): r for r in sc.check(bad, "100000")}
    for host in ("controller", "h0"):
        assert judged[(host, "underlay mtu")].status == sc.FAIL
    assert judged[("hosts file", "overlay size")].status == sc.FAIL
    assert judged[("hosts file", "overlay_encrypted")].status == sc.FAIL
    assert f"set overlay_mtu <= {mtu - 50} in the hosts file" in out

    assert swarm_of(engine.info()) == before  # read-only: the swarm state is as it was


def _prefix(address: str) -> int:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        return next(a["prefixlen"] for a in ipr.get_addr(family=socket.AF_INET) if a.get_attr("IFA_ADDRESS") == address)


def _table(out: str) -> dict[tuple[str, str], str]:
    """(host, check) -> status of the printed table, cut at the header's columns."""
    lines = out.splitlines()
    head = lines[0]
    check, status, detail = head.index("CHECK"), head.index("STATUS"), head.index("DETAIL")
    rows = {}
    for line in lines[1:]:
        if len(line) > detail and line[status:detail].strip() in ("ok", "FAIL", "warn", "info"):
            rows[(line[:check].strip(), line[check:status].strip())] = line[status:detail].strip()
    return rows
