"""What this host offers a Docker Swarm overlay, read without changing anything.

``probe(body)`` answers the agent's ``swarm_probe`` operation (``POST /swarm/probe``) and the
controller's own check of its machine (``controller.swarm_check``). Body::

    {"version": 1, "manager": "10.254.0.1", "peers": ["10.254.0.2", ...], "overlay_mtu": 1450}

The answer holds facts only; the controller judges them:

- ``engine``: the local Docker engine (``DOCKER_HOST`` or the default socket): its version
  and its swarm state (``inactive``/``active``/..., node id, node address, manager or not,
  cluster id, the managers it knows);
- ``kernel``: for vxlan, ifb, sch_htb and ip_vs whether the kernel has them: ``available``,
  ``absent`` or ``unknown``, with where that was read (``/sys/module``, ``/proc/modules``,
  ``modules.builtin``, ``modules.dep``, the kernel's config). Nothing is loaded or created;
- ``underlay``: the interface that routes towards the manager and its MTU (the interface
  holding the address when the manager is this machine);
- ``networks`` and ``routes``: this host's interface networks and routed prefixes (IPv4);
- ``tcp``: whether a TCP connection opens to the manager's 2377 and each peer's 7946 (closed
  again at once; UDP cannot be probed without a responder).
"""
from __future__ import annotations

import gzip
import ipaddress
import os
import re
import socket
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Optional

from worker.api import bodies
from worker.api.protocol import API_VERSION
from worker.api.schema import IPV4_ADDRESS, Field, Schema

MANAGER_PORT = 2377
GOSSIP_PORT = 7946
CONNECT_TIMEOUT_S = 2.0
MIN_MTU, MAX_MTU = 1280, 8950
MODULES = {"vxlan": "CONFIG_VXLAN", "ifb": "CONFIG_IFB", "sch_htb": "CONFIG_NET_SCH_HTB", "ip_vs": "CONFIG_IP_VS"}
AVAILABLE, ABSENT, UNKNOWN = "available", "absent", "unknown"

SWARM_PROBE = Schema({
    "version": bodies.VERSION,
    "manager": bodies.ADDRESS,
    "peers": Field(list, "the other swarm hosts' LAN addresses", default=[], items=IPV4_ADDRESS, max_items=4096),
    "overlay_mtu": Field(int, "the overlay's MTU", default=1450, low=MIN_MTU, high=MAX_MTU)})


# kernel facts -----------------------------------------------------------------------------------
def _module_key(name: str) -> str:
    return name.replace("-", "_")


def _ko_names(text: str, first_column: bool) -> set[str]:
    """Module names of a modules.builtin or modules.dep text (``kernel/.../vxlan.ko[.xz]``)."""
    names = set()
    for line in text.splitlines():
        path = line.split(":", 1)[0].strip() if first_column else line.strip()
        match = re.search(r"([^/]+)\.ko(?:\.[a-z]+)?$", path)
        if match:
            names.add(_module_key(match.group(1)))
    return names


def config_value(config_text: str, symbol: str) -> Optional[str]:
    """``y``, ``m`` or ``n`` for ``symbol`` in a kernel config text (None when not mentioned)."""
    for line in config_text.splitlines():
        if line.startswith(f"{symbol}="):
            return line.split("=", 1)[1].strip()
        if line.strip() == f"# {symbol} is not set":
            return "n"
    return None


def module_state(name: str, sys_modules: Optional[set[str]], proc_modules: Optional[str],
                 builtin: Optional[str], dep: Optional[str], config: Optional[str]) -> dict[str, str]:
    """Whether the kernel has module ``name`` (``state``), and where that was read (``source``).

    Sources, each None when it could not be read: the names under /sys/module, /proc/modules,
    modules.builtin, modules.dep and the kernel config. ``unknown`` when none of them tells."""
    key = _module_key(name)
    if sys_modules is not None and key in sys_modules:
        return {"state": AVAILABLE, "source": f"/sys/module/{key}"}
    if proc_modules is not None and key in {_module_key(line.split()[0]) for line in proc_modules.splitlines()
                                            if line.split()}:
        return {"state": AVAILABLE, "source": "/proc/modules (loaded)"}
    if builtin is not None and key in _ko_names(builtin, False):
        return {"state": AVAILABLE, "source": "modules.builtin (built in)"}
    if dep is not None and key in _ko_names(dep, True):
        return {"state": AVAILABLE, "source": "modules.dep (loadable)"}
    symbol = MODULES.get(name)
    value = config_value(config, symbol) if config is not None and symbol else None
    if value == "y":
        return {"state": AVAILABLE, "source": f"kernel config {symbol}=y (built in)"}
    if value == "m" and dep is None:
        return {"state": AVAILABLE, "source": f"kernel config {symbol}=m (a module)"}
    if value in ("n", "m"):  # =m with modules.dep read: the module file is not installed
        return {"state": ABSENT, "source": f"kernel config {symbol}={value}" + (", not in modules.dep" if value == "m"
                                                                               else "")}
    if builtin is not None and dep is not None:
        return {"state": ABSENT, "source": "neither built in nor in modules.dep"}
    return {"state": UNKNOWN, "source": "no module list or kernel config readable"}


def _read(path: str) -> Optional[str]:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                return f.read()
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def kernel_facts(release: Optional[str] = None) -> dict[str, Any]:
    """vxlan, ifb, sch_htb and ip_vs on this kernel (``module_state`` of each), read-only."""
    release = release or os.uname().release
    try:
        sys_modules: Optional[set[str]] = set(os.listdir("/sys/module"))
    except OSError:
        sys_modules = None
    lib = f"/lib/modules/{release}"
    config = _read("/proc/config.gz") or _read(f"/boot/config-{release}")
    sources = (sys_modules, _read("/proc/modules"), _read(f"{lib}/modules.builtin"), _read(f"{lib}/modules.dep"),
               config)
    return {"release": release, "modules": {name: module_state(name, *sources) for name in MODULES}}


# the network ---------------------------------------------------------------------------------------
def underlay(dst: str) -> dict[str, Any]:
    """The interface this host sends to ``dst`` by and its MTU (``mtu`` None, ``problem`` said,
    when unknown); ``dst`` held by this host: the interface holding it."""
    try:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            routes = ipr.route("get", dst=dst)
            index = routes[0].get_attr("RTA_OIF") if routes else None
            if index is None:
                return {"dst": dst, "ifname": None, "mtu": None, "problem": f"no route to {dst}"}
            link = ipr.get_links(index)[0]
            if link["flags"] & 0x8:  # IFF_LOOPBACK: the address is this host's own
                held = [a["index"] for a in ipr.get_addr(family=socket.AF_INET) if a.get_attr("IFA_ADDRESS") == dst]
                if held:
                    link = ipr.get_links(held[0])[0]
            return {"dst": dst, "ifname": link.get_attr("IFLA_IFNAME"), "mtu": link.get_attr("IFLA_MTU"),
                    "problem": None}
    except Exception as e:  # noqa: BLE001 - netlink refused or no route: reported, not raised
        return {"dst": dst, "ifname": None, "mtu": None, "problem": f"cannot read the route to {dst}: {e}"}


def networks() -> tuple[list[str], list[str]]:
    """This host's IPv4 interface networks and its routed prefixes (main table, default route left out)."""
    from pyroute2 import IPRoute

    nets: set[str] = set()
    routes: set[str] = set()
    with IPRoute() as ipr:
        for a in ipr.get_addr(family=socket.AF_INET):
            nets.add(str(ipaddress.IPv4Interface(f"{a.get_attr('IFA_ADDRESS')}/{a['prefixlen']}").network))
        for r in ipr.get_routes(family=socket.AF_INET, table=254):
            dst = r.get_attr("RTA_DST")
            if dst and r["dst_len"] > 0:
                routes.add(str(ipaddress.IPv4Network(f"{dst}/{r['dst_len']}", strict=False)))
    return sorted(nets), sorted(routes)


def tcp_open(address: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """Whether a TCP connection to ``address:port`` opens (closed at once), and why not."""
    try:
        with socket.create_connection((address, port), timeout=timeout_s):
            return {"address": address, "port": port, "open": True, "problem": None}
    except socket.timeout:
        return {"address": address, "port": port, "open": False, "problem": f"no answer within {timeout_s:g} s"}
    except OSError as e:
        return {"address": address, "port": port, "open": False, "problem": e.strerror or str(e)}


def tcp_facts(manager: str, peers: Iterable[str]) -> list[dict[str, Any]]:
    """``tcp_open`` to the manager's 2377 and each peer's 7946 (and the manager's), in parallel."""
    targets = [(manager, MANAGER_PORT), (manager, GOSSIP_PORT)]
    targets += [(p, GOSSIP_PORT) for p in dict.fromkeys(peers) if p != manager]
    with ThreadPoolExecutor(max_workers=min(32, len(targets))) as pool:
        return list(pool.map(lambda t: tcp_open(*t), targets))


# the engine --------------------------------------------------------------------------------------
def engine_facts() -> dict[str, Any]:
    """The local engine's version and swarm state (``problem`` when no engine answers)."""
    from worker.api.errors import TestbedError
    from worker.nodes.docker import PROBE_TIMEOUT_S, connect
    from worker.nodes.docker_exec import short_error
    from worker.nodes.docker_swarm import swarm_of

    try:
        api = connect(PROBE_TIMEOUT_S)
    except TestbedError as e:
        return {"problem": e.message, "version": None, "api_version": None, "swarm": None}
    try:
        version = api.version()
        return {"problem": None, "version": version.get("Version"), "api_version": version.get("ApiVersion"),
                "swarm": swarm_of(api.info())}
    except Exception as e:  # noqa: BLE001 - the engine went away between the calls
        return {"problem": f"the Docker engine did not answer: {short_error(e)}", "version": None,
                "api_version": None, "swarm": None}
    finally:
        api.close()


def probe(body: Any) -> dict[str, Any]:
    """The facts of this host for a swarm fabric (module docstring); changes nothing."""
    body = bodies.checked(SWARM_PROBE, body)
    try:
        nets, routes = networks()
        problem = None
    except Exception as e:  # noqa: BLE001 - netlink unavailable: the subnet check says unknown
        nets, routes, problem = [], [], f"cannot read the interfaces: {e}"
    with ThreadPoolExecutor(max_workers=2) as pool:
        engine = pool.submit(engine_facts)
        tcp = pool.submit(tcp_facts, body["manager"], body["peers"])
        return {"version": API_VERSION, "hostname": socket.gethostname(), "engine": engine.result(),
                "kernel": kernel_facts(), "underlay": underlay(body["manager"]),
                "overlay_mtu": body["overlay_mtu"], "networks": nets, "routes": routes,
                "networks_problem": problem, "tcp": tcp.result()}
