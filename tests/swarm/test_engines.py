"""The swarm tier's own infrastructure: three Docker hosts on one machine, each its own engine
in its own namespace with the node image, an agent on it, a clean teardown, and a swarm formed
across them by hand whose overlay carries traffic between hosts."""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import signal
import subprocess
from typing import Any, Optional

import pytest

from tests.swarm.conftest import SWARM, wait_until
from tests.swarm.engines import (DATA_BASE, EXEC_BASE, OVERLAY_SUBNET, SwarmLan, hosts_document, root_api,
                                 sweep_stale, write_hosts_json)
from worker.kernel import nsfs

pytestmark = SWARM

SWARM_PORT = 2377
OVERLAY_MTU = 1450
# Docker's overlay driver reads com.docker.network.driver.mtu as the VXLAN device's MTU: its
# containers get that less the VXLAN header (measured on 20.10: option 1450 -> eth0 1400)
VXLAN_OVERHEAD_BYTES = 50


def test_three_engines_answer_each_its_own(swarm_hosts):
    root = root_api()
    try:
        root_id = root.info()["ID"]
    finally:
        root.close()
    infos = []
    for host in swarm_hosts:
        engine = host["engine"]
        api = engine.api()
        try:
            info = api.info()
        finally:
            api.close()
        infos.append(info)
        assert info["DockerRootDir"] == str(engine.data_root), (host["name"], info["DockerRootDir"])
        assert info["Swarm"]["LocalNodeState"] == "inactive", (host["name"], info["Swarm"])
        # dockerd runs in the host's namespace, not in this one
        assert os.stat(f"/proc/{engine.proc.pid}/ns/net").st_ino == nsfs.inode(host["netns"]), host["name"]
        assert os.stat(f"/proc/{engine.proc.pid}/ns/net").st_ino != os.stat("/proc/self/ns/net").st_ino
    ids = [info["ID"] for info in infos]
    assert len(set(ids)) == 3 and root_id not in ids, (root_id, ids)
    assert len({info["DockerRootDir"] for info in infos}) == 3


def test_each_engine_has_the_node_image_and_runs_it(swarm_lan, swarm_hosts, node_image_tar):
    _, image_id = node_image_tar
    for host in swarm_hosts:
        api = host["engine"].api()
        try:
            assert api.inspect_image(swarm_lan.image)["Id"] == image_id, host["name"]
            cid = api.create_container(swarm_lan.image, ["cat", "/etc/debian_version"],
                                       host_config=api.create_host_config(network_mode="none"))["Id"]
            try:
                api.start(cid)
                assert api.wait(cid, timeout=60)["StatusCode"] == 0, host["name"]
                assert api.logs(cid).decode().strip().split(".")[0].isdigit(), api.logs(cid)
            finally:
                api.remove_container(cid, force=True)
        finally:
            api.close()


def test_agents_make_docker_nodes_on_their_own_engine(swarm_lan, swarm_hosts):
    for host in swarm_hosts:
        caps = swarm_lan.client(host).capabilities()
        assert caps["runtime"] == "docker" and "docker" in caps["runtimes"], (host["name"], caps)
        assert caps["docker"]["available"] and caps["docker"]["image"] == swarm_lan.image, (host["name"], caps)
    # a node made by h1's agent is a container of h1's engine, of no other
    h1 = swarm_hosts[1]
    agent = swarm_lan.client(h1)
    made = agent.create_nodes({"version": 1, "nodes": [{"name": "a"}]})["nodes"]
    try:
        name = made[0]["container"]
        for host in swarm_hosts:
            api = host["engine"].api()
            try:
                names = [n.lstrip("/") for c in api.containers(all=True) for n in c["Names"]]
            finally:
                api.close()
            assert (name in names) == (host is h1), (host["name"], names)
        root = root_api()
        try:
            assert not root.containers(all=True, filters={"name": name}), name
        finally:
            root.close()
        out = agent.exec("a", {"version": 1, "argv": ["ip", "-4", "-o", "addr", "show", "eth0"], "timeout_s": 30})
        assert out["returncode"] == 0 and f"inet {made[0]['ip']}/" in out["stdout"], out
    finally:
        removed = agent.reset()
    assert removed["removed"]["nodes"] == 1, removed


def test_hosts_json_names_every_host(tmp_path, swarm_lan, swarm_hosts):
    path = write_hosts_json(tmp_path / "hosts.json", swarm_lan, swarm_hosts)
    doc = json.loads(path.read_text())
    assert doc == hosts_document(swarm_lan, swarm_hosts)
    assert doc["engine"] == "swarm" and doc["controller_ip"] == swarm_lan.ip(None)
    assert doc["overlay_subnet"] == OVERLAY_SUBNET and "overlay_mtu" not in doc
    assert [(h["name"], h["agent"], h["runtime"]) for h in doc["hosts"]] == \
        [(f"h{i}", f"https://{swarm_lan.ip(i)}:3334", "docker") for i in range(3)]
    for entry, host in zip(doc["hosts"], swarm_hosts):
        assert entry["tls_fingerprint"] == host["fingerprint"] and entry["token_file"] == str(host["token_file"])
        assert open(entry["token_file"]).read().strip() == host["token"]


def test_teardown_leaves_nothing(tmp_path, node_image_tar):
    tar, image_id = node_image_tar
    lan = SwarmLan(tmp_path)
    try:
        host = lan.add_docker_hosts(1, tar, image_id)[0]
        engine = host["engine"]
        api = engine.api()
        try:  # a running container: a shim, its mounts, its cgroup and namespace
            cid = api.create_container(lan.image, ["sleep", "infinity"])["Id"]
            api.start(cid)
            pid = api.inspect_container(cid)["State"]["Pid"]
        finally:
            api.close()
        before = engine.leftovers()
        # what the check looks for is there while the engine runs
        assert any("dockerd" in p for p in before["processes"]), before
        assert any("containerd-shim" in p for p in before["processes"]), before
        assert any(p.startswith(f"{pid} ") for p in before["processes"]), (pid, before)
        assert any(m.endswith("/merged") for m in before["mounts"]), before
        assert set(before["dirs"]) == {str(engine.data_root), str(engine.exec_root)} and before["cgroups"], before
    finally:
        left = lan.close()
    assert not left, left
    assert not os.path.exists(f"/proc/{pid}"), pid
    after = lan.leftovers()
    assert all(not items for items in after.values()), after
    assert not engine.data_root.exists() and not engine.exec_root.exists()
    assert not engine.data_root.parent.exists() and not engine.exec_root.parent.exists()
    assert not any(n.startswith(f"mh{lan.tag}") for n in nsfs.list_netns())
    assert lan.timings_s["teardown"] < 30, lan.timings_s


def test_engines_of_a_dead_run_are_swept(tmp_path):
    lan = SwarmLan(tmp_path)
    try:
        engine = lan.add_docker_hosts(1, None)[0]["engine"]
        assert lan.tag not in sweep_stale(), "the engines of a live run were swept"
        dead = subprocess.run(["sh", "-c", "echo $$"], capture_output=True, text=True, check=True)
        lan.owner.write_text(f"{dead.stdout.strip()} 0\n")  # as if its run were killed
        assert lan.tag in sweep_stale()
        assert engine.proc.wait(timeout=10) == -signal.SIGKILL
        assert all(not items for items in engine.leftovers().values()), engine.leftovers()
        assert not (DATA_BASE / lan.tag).exists() and not (EXEC_BASE / lan.tag).exists()
    finally:
        left = lan.close()
    # its agent cannot reset on an engine that is gone: that is said, and nothing else is left
    assert [line for line in left if not line.startswith("problems: ")] == [], left


# a swarm formed by hand ----------------------------------------------------------------------
def _swarm_state(api: Any) -> str:
    return api.info()["Swarm"]["LocalNodeState"]


def _ready_nodes(api: Any) -> list[str]:
    return sorted(n["Status"].get("Addr", "?") for n in api.nodes() if n["Status"]["State"] == "ready")


def _overlay_ip(api: Any, cid: str, network: str) -> str:
    return api.inspect_container(cid)["NetworkSettings"]["Networks"][network]["IPAddress"]


def _exec(api: Any, cid: str, *argv: str) -> tuple[int, str]:
    run = api.exec_create(cid, list(argv))
    out = api.exec_start(run["Id"]).decode(errors="replace")
    return api.exec_inspect(run["Id"])["ExitCode"], out


def _form_swarm_and_ping(lan: SwarmLan, manager: Any, manager_ip: str, workers: list[dict]) -> None:
    """``manager`` (an engine in no swarm) initialises one advertised at ``manager_ip``; ``workers``
    join it; a container of each member on an internal attachable overlay pings the next member's
    around the ring. Everything leaves (the manager last) and is removed, on every exit."""
    docker = pytest.importorskip("docker")
    tag = secrets.token_hex(2)
    network = f"etbt-{tag}-ov"
    subnet = ipaddress.ip_network(f"10.81.{int(tag, 16) % 250}.0/24")
    apis = {h["name"]: h["engine"].api() for h in workers}
    made: list[tuple[str, Any, str]] = []
    gwbridge_before = bool(manager.networks(names=["docker_gwbridge"]))
    manager.init_swarm(advertise_addr=manager_ip, listen_addr=f"0.0.0.0:{SWARM_PORT}", data_path_addr=manager_ip)
    try:
        token = manager.inspect_swarm()["JoinTokens"]["Worker"]
        for host in workers:
            assert apis[host["name"]].join_swarm([f"{manager_ip}:{SWARM_PORT}"], token, advertise_addr=host["ip"],
                                                 data_path_addr=host["ip"])
        ready = wait_until(lambda: len(_ready_nodes(manager)) == 1 + len(workers) and _ready_nodes(manager), 60,
                           "every engine Ready in the swarm")
        assert ready == sorted([manager_ip] + [h["ip"] for h in workers]), ready
        manager.create_network(network, driver="overlay", attachable=True, internal=True, check_duplicate=True,
                               ipam=docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=str(subnet))]),
                               options={"com.docker.network.driver.mtu": str(OVERLAY_MTU + VXLAN_OVERHEAD_BYTES)},
                               labels={"edgetb.test": tag})
        for name, api in [("manager", manager), *apis.items()]:
            cid = api.create_container(lan.image, ["sleep", "infinity"], name=f"etbt-{tag}-{name}",
                                       host_config=api.create_host_config(network_mode=network))["Id"]
            made.append((name, api, cid))
            api.start(cid)
        ips = [_overlay_ip(api, cid, network) for _, api, cid in made]
        assert all(ipaddress.ip_address(ip) in subnet for ip in ips) and len(set(ips)) == len(ips), ips
        for k, (name, api, cid) in enumerate(made):
            peer = ips[(k + 1) % len(made)]
            wait_until(lambda: _exec(api, cid, "ping", "-c", "1", "-W", "1", peer)[0] == 0, 30,
                       f"the container of {name} pinging {peer} over the overlay")
            # the overlay's MTU, and internal: no way out of it (no default route)
            assert _exec(api, cid, "cat", "/sys/class/net/eth0/mtu") == (0, f"{OVERLAY_MTU}\n"), name
            assert _exec(api, cid, "ip", "-4", "route", "show", "default") == (0, ""), name
    finally:
        _dismantle(manager, apis, [(api, cid) for _, api, cid in made], network, gwbridge_before)


def _dismantle(manager: Any, apis: dict[str, Any], made: list[tuple[Any, str]], network: str,
               gwbridge_before: bool) -> None:
    """Remove the containers and the overlay, make the workers leave and then the manager; the
    engines' gateway bridges go too (the manager's only when it had none before)."""
    problems = []
    try:
        for api, cid in made:
            try:
                api.remove_container(cid, force=True)
            except Exception as e:
                problems.append(f"container {cid[:12]}: {e}")
        try:
            wait_until(lambda: _remove_network(manager, network), 30, f"removal of {network}")
        except AssertionError as e:
            problems.append(str(e))
        for name, api in apis.items():
            try:
                if _swarm_state(api) != "inactive":
                    api.leave_swarm(force=True)
                _remove_gwbridge(api)
            except Exception as e:
                problems.append(f"{name}: {e}")
            api.close()
    finally:
        manager.leave_swarm(force=True)
    if not gwbridge_before:
        _remove_gwbridge(manager)
    assert _swarm_state(manager) == "inactive"
    assert not problems, problems


def _remove_network(api: Any, name: str) -> bool:
    import docker

    try:
        api.remove_network(name)
    except docker.errors.NotFound:
        return True
    except docker.errors.APIError:  # endpoints still being released
        return False
    return True


def _remove_gwbridge(api: Any) -> None:
    for net in api.networks(names=["docker_gwbridge"]):
        wait_until(lambda: _remove_network(api, net["Id"]), 15, "removal of docker_gwbridge")


def _leave_clean(hosts: list[dict]) -> None:
    for host in hosts:
        api = host["engine"].api()
        try:
            assert _swarm_state(api) == "inactive", host["name"]
            assert not api.containers(all=True), host["name"]
            assert not api.networks(names=["docker_gwbridge"]), host["name"]
        finally:
            api.close()


def test_swarm_of_the_host_engines_carries_traffic_across_hosts(swarm_lan, swarm_hosts):
    """h0's engine manages; h1 and h2 join; containers on h0, h1, h2 ping around the ring."""
    h0, h1, h2 = swarm_hosts
    manager = h0["engine"].api()
    try:
        _form_swarm_and_ping(swarm_lan, manager, h0["ip"], [h1, h2])
    finally:
        manager.close()
    _leave_clean(swarm_hosts)


def test_swarm_managed_by_the_root_engine_carries_traffic_across_hosts(swarm_lan, swarm_hosts):
    """The root engine (the controller's) manages, advertised at the LAN's .1; the three join;
    containers on the root engine and the three ping around the ring. Only when the root engine is
    in no swarm (a swarm of another's is not this test's to leave)."""
    manager = root_api()
    try:
        state: Optional[str] = _swarm_state(manager)
        if state != "inactive":
            pytest.skip(f"the root engine is in a swarm already ({state}): it is not this test's to leave")
        _form_swarm_and_ping(swarm_lan, manager, swarm_lan.ip(None), swarm_hosts)
    finally:
        manager.close()
    _leave_clean(swarm_hosts)
