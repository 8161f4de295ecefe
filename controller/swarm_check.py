"""``edgetb swarm check``: can the machines of a hosts file form the swarm fabric? Read-only.

The controller's machine (its engine: the swarm manager) is probed in this process and every
Docker host through its agent (``swarm_probe``, over its pinned HTTPS channel); both answer with
``worker.swarm_probe``'s facts, judged here into rows ``(host, check, status, detail, fix)``,
status ``ok``, ``FAIL``, ``warn`` or ``info``. Nothing is created, joined or changed anywhere.

Checks: engine version >= 20.10; swarm state (a host in another swarm than the controller's
engine fails); vxlan, ifb, sch_htb in the kernel (ip_vs absent: a warning); underlay MTU >=
overlay MTU + 50 towards the controller; TCP to the manager's 2377 and to each swarm peer's 7946;
the overlay subnet against every host's networks and routes, the controller's and the hosts'
addresses, and the number of nodes; encrypted overlays refused.
"""
from __future__ import annotations

import ipaddress
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional

from worker.api.errors import ConfigError, TestbedError, TopologyError
from worker.api.protocol import API_VERSION
from controller.model.hosts import ENCRYPTED_REFUSAL, VXLAN_OVERHEAD_BYTES, load_hosts, overlay_capacity
from worker.api.schema import read_json

MIN_ENGINE = (20, 10)
CONTROLLER = "controller"
OK, FAIL, WARN, INFO = "ok", "FAIL", "warn", "info"
REQUIRED_MODULES = ("vxlan", "ifb", "sch_htb")


@dataclass(frozen=True)
class Row:
    """One check's outcome; ``fix`` says what to do when it is not ok."""

    host: str
    check: str
    status: str
    detail: str
    fix: str = ""


# the pure decisions -------------------------------------------------------------------------------
def engine_version(text: Optional[str]) -> Optional[tuple[int, int]]:
    """(major, minor) of a Docker version such as ``20.10.24+dfsg1`` or ``17.06.2-ce`` (None: unreadable)."""
    match = re.search(r"^\s*v?(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def version_ok(text: Optional[str]) -> bool:
    version = engine_version(text)
    return version is not None and version >= MIN_ENGINE


def mtu_ok(underlay_mtu: int, overlay_mtu: int) -> bool:
    """The underlay carries an overlay packet with VXLAN's 50 bytes around it."""
    return underlay_mtu >= overlay_mtu + VXLAN_OVERHEAD_BYTES


def overlaps(subnet: ipaddress.IPv4Network, prefixes: list[str]) -> list[str]:
    """The prefixes (``a.b.c.d/n``) that share an address with ``subnet``."""
    return [p for p in prefixes if subnet.overlaps(ipaddress.IPv4Network(p, strict=False))]


def exit_code(rows: list[Row]) -> int:
    """2 when a check failed, else 0 (warnings and information do not fail)."""
    return 2 if any(r.status == FAIL for r in rows) else 0


def same_swarm(host: dict[str, Any], manager: dict[str, Any], manager_addrs: set[str]) -> bool:
    """Whether the swarm ``host`` is in is the manager engine's (both ``swarm_of`` facts): same node,
    same cluster id, or (a worker knows no cluster id) a manager address of the manager's."""
    if host.get("node_id") and host["node_id"] == manager.get("node_id"):
        return True
    if host.get("cluster_id") and manager.get("cluster_id"):
        return host["cluster_id"] == manager["cluster_id"]
    hosts_managers = {m.rsplit(":", 1)[0] for m in host.get("managers") or []}
    return bool(hosts_managers & manager_addrs)


def in_swarm(facts: Optional[dict[str, Any]]) -> bool:
    swarm = ((facts or {}).get("engine") or {}).get("swarm") or {}
    return swarm.get("state") == "active"


def engine_rows(name: str, facts: dict[str, Any], controller: Optional[dict[str, Any]], controller_ip: str) -> list[Row]:
    """Engine version and swarm state of ``name`` (``controller``: the controller's own facts,
    None when ``name`` is the controller)."""
    engine = facts.get("engine") or {}
    if engine.get("problem"):
        return [Row(name, "engine", FAIL, engine["problem"], "start Docker there (bash scripts/docker_setup.sh)")]
    version = engine.get("version")
    rows = [Row(name, "engine", OK if version_ok(version) else FAIL, f"Docker {version}",
                "" if version_ok(version) else "install Docker 20.10 or newer")]
    swarm = engine.get("swarm") or {}
    state = swarm.get("state", "inactive")
    role = "manager" if swarm.get("manager") else "worker"
    cluster = f", cluster {swarm['cluster_id']}" if swarm.get("cluster_id") else ""
    if controller is None:  # the manager-to-be
        if state == "inactive":
            rows.append(Row(name, "swarm", OK, "inactive: up initialises a swarm"))
        elif state == "active" and swarm.get("manager"):
            rows.append(Row(name, "swarm", OK, f"active, manager{cluster}: up uses this swarm"))
            if swarm.get("node_addr") and swarm["node_addr"] != controller_ip:
                rows.append(Row(name, "swarm address", WARN, f"the swarm advertises {swarm['node_addr']}, not "
                                f"controller_ip {controller_ip}",
                                f"the hosts must reach {swarm['node_addr']} (VXLAN, gossip); or leave this swarm "
                                "('docker swarm leave --force') so that up makes one on controller_ip"))
        else:
            rows.append(Row(name, "swarm", FAIL, f"{state}, {role}{cluster}" + (f": {swarm['error']}" if
                                                                               swarm.get("error") else ""),
                            "the controller's engine must be a swarm manager or in no swarm: 'docker swarm leave' "
                            "there (or promote it)"))
        return rows
    if state == "inactive":
        rows.append(Row(name, "swarm", OK, "inactive: joins the controller's swarm at up"))
        return rows
    ctl = ((controller.get("engine") or {}).get("swarm")) or {}
    addrs = {controller_ip} | ({ctl["node_addr"]} if ctl.get("node_addr") else set())
    addrs |= {m.rsplit(":", 1)[0] for m in ctl.get("managers") or []}
    detail = f"{state}, {role}{cluster}, node {swarm.get('node_id')}"
    if state == "active" and ctl.get("state") == "active" and same_swarm(swarm, ctl, addrs):
        same = "the controller's engine itself" if swarm.get("node_id") == ctl.get("node_id") else "the controller's swarm"
        rows.append(Row(name, "swarm", OK, f"{detail}: {same}"))
    else:
        why = "the controller's engine is in no swarm" if ctl.get("state") != "active" else "not the controller's swarm"
        rows.append(Row(name, "swarm", FAIL, f"{detail}: {why}",
                        f"on {name}: 'docker swarm leave' (it joins the controller's swarm at up)"))
    return rows


def kernel_rows(name: str, facts: dict[str, Any]) -> list[Row]:
    modules = (facts.get("kernel") or {}).get("modules") or {}
    rows = []
    for module in REQUIRED_MODULES:
        fact = modules.get(module) or {"state": "unknown", "source": "not reported"}
        status = {"available": OK, "absent": FAIL}.get(fact["state"], WARN)
        fix = {FAIL: f"a kernel with {module} (CONFIG_{module.upper()}) is needed",
               WARN: f"check by hand that the kernel has {module}"}.get(status, "")
        rows.append(Row(name, module, status, f"{fact['state']} ({fact['source']})", fix))
    fact = modules.get("ip_vs") or {"state": "unknown", "source": "not reported"}
    if fact["state"] == "available":
        rows.append(Row(name, "ip_vs", OK, f"available ({fact['source']})"))
    else:
        rows.append(Row(name, "ip_vs", WARN, f"{fact['state']} ({fact['source']}): services use DNS round-robin, "
                        "published ingress ports are refused", "nothing, unless services need virtual IPs"))
    return rows


def mtu_rows(name: str, facts: dict[str, Any], overlay_mtu: int) -> list[Row]:
    under = facts.get("underlay") or {}
    if under.get("mtu") is None:
        return [Row(name, "underlay mtu", WARN, under.get("problem") or "unknown",
                    f"check that the interface towards the controller has MTU >= {overlay_mtu + VXLAN_OVERHEAD_BYTES}")]
    detail = f"{under.get('ifname')} mtu {under['mtu']} towards {under.get('dst')}; needs >= {overlay_mtu} + 50"
    if mtu_ok(under["mtu"], overlay_mtu):
        return [Row(name, "underlay mtu", OK, detail)]
    return [Row(name, "underlay mtu", FAIL, detail,
                f"set overlay_mtu <= {under['mtu'] - VXLAN_OVERHEAD_BYTES} in the hosts file, or raise the underlay's MTU")]


def port_rows(name: str, facts: dict[str, Any], swarm_by_ip: dict[str, bool], controller_ip: str,
              manager_listening: bool) -> list[Row]:
    """TCP reachability from ``name``: the manager's 2377, and 7946 of each peer in a swarm
    (``swarm_by_ip``: whether each address's engine is in one; a peer not there is unknown)."""
    rows = []
    for probe in facts.get("tcp") or []:
        address, port = probe["address"], probe["port"]
        target = f"{address}:{port}/tcp"
        listening = manager_listening if port == 2377 else swarm_by_ip.get(address)
        if probe["open"]:
            rows.append(Row(name, f"tcp {target}", OK, "connects"))
        elif listening is None:
            rows.append(Row(name, f"tcp {target}", WARN, f"{probe['problem']}: the swarm state of {address} is "
                            "unknown (its agent did not answer)", f"check again once {address}'s agent answers"))
        elif not listening:
            who = "the manager" if address == controller_ip else address
            rows.append(Row(name, f"tcp {target}", WARN, f"{probe['problem']}: {who} is in no swarm, not listening "
                            "yet (the swarm is made at up)"))
        else:
            rows.append(Row(name, f"tcp {target}", FAIL, probe["problem"] or "closed",
                            f"open {port}/tcp from {name} to {address} in the firewalls between them"))
    rows.append(Row(name, "udp", INFO, "udp: open 4789/udp and 7946/udp in the firewall (not probed: no responder)"))
    return rows


def subnet_rows(subnet: ipaddress.IPv4Network, facts_by_host: dict[str, dict[str, Any]],
                nodes: Optional[int]) -> list[Row]:
    """The overlay subnet against every host's networks and routes, and the number of nodes (its
    holding no host's address is the hosts file's own rule, ``load_hosts``)."""
    rows = []
    for name, facts in facts_by_host.items():
        if facts.get("networks_problem"):
            rows.append(Row(name, "overlay subnet", WARN, facts["networks_problem"], "check its routes by hand"))
            continue
        clash = overlaps(subnet, sorted(set(facts.get("networks") or []) | set(facts.get("routes") or [])))
        if clash:
            rows.append(Row(name, "overlay subnet", FAIL, f"{subnet} overlaps {', '.join(clash)} there",
                            "choose another overlay_subnet in the hosts file"))
        else:
            rows.append(Row(name, "overlay subnet", OK, f"{subnet} overlaps none of its networks and routes"))
    usable = overlay_capacity(str(subnet))
    if nodes is None:
        rows.append(Row("hosts file", "overlay size", INFO, f"{subnet}: room for {usable} nodes"))
    elif nodes > usable:
        rows.append(Row("hosts file", "overlay size", FAIL, f"{subnet}: room for {usable} nodes, {nodes} needed",
                        f"a larger overlay_subnet (a /20 holds {overlay_capacity('10.80.0.0/20')} nodes)"))
    else:
        rows.append(Row("hosts file", "overlay size", OK, f"{subnet}: room for {usable} nodes, {nodes} needed"))
    return rows


def encryption_rows(encrypted: bool) -> list[Row]:
    if not encrypted:
        return []
    return [Row("hosts file", "overlay_encrypted", FAIL,
                ENCRYPTED_REFUSAL,
                "remove overlay_encrypted (or set it false)")]


def render(rows: list[Row]) -> str:
    """The table, then what to do for each failure."""
    table = [("HOST", "CHECK", "STATUS", "DETAIL")] + [(r.host, r.check, r.status, r.detail) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(3)]
    lines = ["  ".join([t[0].ljust(widths[0]), t[1].ljust(widths[1]), t[2].ljust(widths[2]), t[3]]) for t in table]
    todo = [f"  {r.host}, {r.check}: {r.fix}" for r in rows if r.status == FAIL and r.fix]
    failed = sum(r.status == FAIL for r in rows)
    lines.append(f"{failed} checks failed" + (": to do" if todo else "") if failed else
                 "every check passed" + (f" ({sum(r.status == WARN for r in rows)} warnings)"
                                         if any(r.status == WARN for r in rows) else ""))
    return "\n".join(lines + todo)


# reading the files -----------------------------------------------------------------------------------
def count_nodes(value: str, swarm_hosts: set[str]) -> int:
    """``--nodes``: a number, or a nodes or links file whose emulated nodes are counted (those on
    the swarm hosts when its nodes name any of them)."""
    if value.isdigit():
        return int(value)
    from controller.model.topology import load_links, load_nodes
    from controller.calibration import host_kernel_s

    data = read_json(value, TopologyError)
    topology = load_nodes(value, host_kernel_s) if isinstance(data, dict) and isinstance(data.get("nodes"), list) else load_links(value)
    emulated = [n for n in topology.nodes.values() if n.kind == "emulated"]
    placed = [n for n in emulated if n.host in swarm_hosts]
    return len(placed) if placed else len(emulated)


# running it -----------------------------------------------------------------------------------------------
def controller_ip_for(hosts: Any) -> str:
    """The hosts file's controller_ip, else this machine's source address towards the first remote host."""
    if hosts.controller_ip:
        return hosts.controller_ip
    remote = [h.ip for h in hosts.hosts.values() if not h.local and h.ip]
    if not remote:
        raise ConfigError("hosts file: set 'controller_ip' (the swarm manager's address the hosts reach)")
    from controller.workers.cluster import controller_address

    return controller_address(remote[0])


def check(hosts_path: str, nodes: Optional[str] = None,
          client: Optional[Callable[[Any, str], Any]] = None) -> list[Row]:
    """The rows of every check for the hosts file at ``hosts_path`` (``nodes``: ``--nodes``).
    ``client(host, token)`` makes a host's agent client (default: ``AgentClient``, pinned)."""
    from controller.workers.cluster import agent_tokens
    from worker import swarm_probe

    hosts = load_hosts(hosts_path)
    subnet, overlay_mtu = ipaddress.IPv4Network(hosts.overlay_subnet), hosts.overlay_mtu
    rows: list[Row] = encryption_rows(hosts.overlay_encrypted)
    if hosts.engine != "swarm":
        rows.append(Row("hosts file", "engine", WARN, f"engine is {hosts.engine!r}: up uses the routed mode",
                        'set "engine": "swarm" to use the overlay'))
    controller_ip = controller_ip_for(hosts)
    swarm_hosts = [h for h in hosts.hosts.values() if h.runtime == "docker"]
    if not swarm_hosts:
        rows.append(Row("hosts file", "hosts", FAIL, "no host has runtime 'docker': the overlay has no host",
                        "give the swarm hosts \"runtime\": \"docker\""))
    asked = [h for h in swarm_hosts if h.agent is not None]  # a host without agent is the controller's engine
    lan_ips = {h.name: h.ip for h in swarm_hosts if h.ip and not h.local}
    tokens = agent_tokens(hosts) if asked else {}
    if client is None:
        from controller.workers.agent_client import AgentClient

        def client(host: Any, token: str) -> Any:
            return AgentClient(host.agent, token, name=host.name, fingerprint=host.tls_fingerprint, timeout_s=60,
                               tries=1)

    def body(own: Optional[str]) -> dict[str, Any]:
        peers = [ip for ip in lan_ips.values() if ip != own]
        return {"version": API_VERSION, "manager": controller_ip, "peers": peers, "overlay_mtu": overlay_mtu}

    def ask(host: Any) -> dict[str, Any]:
        return client(host, tokens[host.name]).swarm_probe(body(lan_ips.get(host.name)))

    facts: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(max_workers=min(16, len(asked) + 1)) as pool:
        local = pool.submit(swarm_probe.probe, body(controller_ip))
        futures = {h.name: pool.submit(ask, h) for h in asked}
        facts[CONTROLLER] = local.result()
        for name, future in futures.items():
            try:
                facts[name] = future.result()
            except TestbedError as e:
                rows.append(Row(name, "agent", FAIL, e.message, "start its agent, check its URL, token and "
                                "tls_fingerprint in the hosts file"))
    manager = facts[CONTROLLER]
    manager_swarm = (manager.get("engine") or {}).get("swarm") or {}
    manager_listening = manager_swarm.get("state") == "active" and bool(manager_swarm.get("manager"))
    swarm_by_ip = {controller_ip: in_swarm(manager)}
    swarm_by_ip.update({lan_ips[n]: in_swarm(f) for n, f in facts.items() if n in lan_ips})
    for name, f in facts.items():
        rows += engine_rows(name, f, None if name == CONTROLLER else manager, controller_ip)
        rows += kernel_rows(name, f)
        rows += mtu_rows(name, f, overlay_mtu)
        rows += port_rows(name, f, swarm_by_ip, controller_ip, manager_listening)
    count = count_nodes(nodes, {h.name for h in swarm_hosts}) if nodes is not None else None
    rows += subnet_rows(subnet, facts, count)
    return rows
