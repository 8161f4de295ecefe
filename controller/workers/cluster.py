"""Several worker hosts driven as one ``Worker``: every call goes to the hosts holding its nodes.

Bring-up order on top of ``deploy``: code is synced to the agents, every host
creates its nodes (in parallel), then every network stack (each host's and the
controller's) gets routes to the other hosts' node subnets, so that every node
reaches every other by its own IP; links are shaped on their source's host. With
``"engine": "swarm"`` the Docker hosts' nodes share a swarm overlay instead
(``controller.workers.swarm``, made before the nodes): they are given its addresses, and the
routed hosts reach the overlay via the controller's machine.
"""
from __future__ import annotations

import ipaddress
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional
from urllib.parse import urlsplit, urlunsplit

from controller.model.hosts import Hosts, node_addresses, plan_routes
from controller.workers.api import Worker
from worker.api.errors import ConfigError, NotFound, TestbedError
from worker.api.protocol import API_VERSION, OPERATIONS, TREES

Progress = Callable[[str], None]


def controller_address(towards: str) -> str:
    """The source address this machine uses to reach ``towards``."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        routes = ipr.route("get", dst=towards)
    source = routes[0].get_attr("RTA_PREFSRC") if routes else None
    if not source:
        raise ConfigError(f"no route from the controller to {towards}: set 'controller_ip' in the hosts file")
    return source


def gateway(subnet: Optional[str]) -> Optional[str]:
    """The first address of a node subnet: its bridge's, where its nodes reach this machine."""
    return str(next(ipaddress.IPv4Network(subnet).hosts())) if subnet else None


def agent_tokens(hosts: Hosts) -> dict[str, str]:
    """Each agent's own token, by host name: from its ``token_file``; a host without one uses
    $EDGETB_TOKEN (or this machine's agent token file) only when it is the one agent, or this
    machine's own agent file when it is the local agent. Two agents with one token are refused:
    root on one host must not be root on another."""
    from worker.agent import default_token_file, load_token, read_token_file

    agents = [h for h in hosts.hosts.values() if h.agent is not None]
    tokens: dict[str, str] = {}
    for host in agents:
        if host.token_file:
            tokens[host.name] = read_token_file(host.token_file)
        elif len(agents) == 1:
            tokens[host.name] = load_token(None, create=False)
        elif host.local:
            tokens[host.name] = read_token_file(default_token_file())
        else:
            raise ConfigError(f"hosts file, host {host.name}: give its 'token_file' (each agent has its own token; "
                              "$EDGETB_TOKEN serves a single agent only)")
    seen: dict[str, str] = {}
    for name, token in tokens.items():
        if token in seen:
            raise ConfigError(f"hosts file: the agents of {seen[token]} and {name} have the same token: give each "
                              "agent its own (root on one host must not open the other)")
        seen[token] = name
    return tokens


def controller_ip_of(hosts: Hosts, workers: dict[str, Worker], in_process: bool) -> str:
    """The address the nodes of ``hosts`` reach the controller by: the hosts file's
    ``controller_ip``, else this machine's source address towards the first remote host, else
    (a loopback agent only) its node subnet's gateway. ``in_process``: a host is this one."""
    local = next((h.name for h in hosts.hosts.values() if h.local), None)
    remote = [h.ip for h in hosts.hosts.values() if not h.local and h.ip]
    controller_ip = hosts.controller_ip or (controller_address(remote[0]) if remote else None)
    if controller_ip is None and local is not None and not in_process:
        controller_ip = gateway(workers[local].capabilities().get("subnet"))  # only a loopback agent
    if controller_ip is None and in_process and len(workers) == 1:
        raise ConfigError("no host has an agent: run single-host (without a hosts file) instead")
    if controller_ip is None:
        raise ConfigError("cannot tell the address nodes reach the controller by: set 'controller_ip' in the "
                          "hosts file")
    return controller_ip


def _on_node_host(name: str) -> Callable[..., Any]:
    """Operation ``name`` (a per-node one) as a Cluster method: sent to the host of its node."""

    def forward(self: "Cluster", node: str, *args: Any) -> Any:
        return getattr(self._worker_of(node), name)(node, *args)

    forward.__name__ = forward.__qualname__ = name
    forward.__doc__ = f"``{name}`` on the host of ``node``."
    return forward


class Cluster:
    """The worker hosts of one experiment, as one Worker (made by controller.workers.connect.connect).
    The per-node operations of worker.api.protocol.OPERATIONS go to their node's host; the
    others go to every host, their answers joined, but for those each host needs its own
    request for (``set_routes``: ``install_routes``; ``sync``: ``sync_code``; ``telemetry_read``:
    read each of ``workers``), which a cluster refuses."""

    is_local = False  # its hosts are its ``workers``, each local or not
    workers: dict[str, Worker]

    def __init__(self, hosts: Hosts, placement: dict[str, str], workers: dict[str, Worker],
                 controller_stack: Worker, controller_ip: str) -> None:
        """``workers`` by host name; ``controller_stack`` installs the controller's own routes
        (the worker of the host sharing its machine, when there is one)."""
        self.hosts = hosts
        self.placement = placement
        self.workers = workers
        self.controller_stack = controller_stack
        self.controller_ip = controller_ip
        self._subnets: dict[str, str] = {}
        # where the controller serves dml_app/ and dataset/ from (controller.workers.files): the manifest
        # of what agents fetch is computed here and sent to them over their own (pinned) channel
        self.trees: Optional[dict[str, str]] = None
        self.tokens: dict[str, str] = {}  # each agent's, by host name
        self.fabric: Optional[Any] = None  # controller.workers.swarm.SwarmFabric, for "engine": "swarm"
        self.progress: Progress = lambda _: None

    # fan-out ---------------------------------------------------------------------------------
    def _each(self, fn: Callable[[str, Worker], Any], names: Optional[list[str]] = None) -> dict[str, Any]:
        """``fn(host, worker)`` on every (listed) host in parallel; the first error is raised
        after all have finished."""
        names = list(self.workers) if names is None else names
        results: dict[str, Any] = {}
        errors: dict[str, BaseException] = {}
        lock = threading.Lock()

        def one(name: str) -> None:
            try:
                value = fn(name, self.workers[name])
                with lock:
                    results[name] = value
            except Exception as e:
                with lock:
                    errors[name] = e

        if names:
            with ThreadPoolExecutor(max_workers=len(names)) as pool:
                list(pool.map(one, names))
        if errors:
            name, error = next(iter(errors.items()))
            if isinstance(error, TestbedError):
                if error.message.startswith(f"agent {name} ("):  # the agent client named the host
                    raise error
                raise type(error)(f"host {name}: {error.message}", detail=error.detail)
            raise error
        return results

    def _worker_of(self, node: str) -> Worker:
        try:
            return self.workers[self.placement[node]]
        except KeyError:
            raise NotFound(f"no node {node!r} in this experiment") from None

    def _split(self, items: list[dict[str, Any]], key: str) -> dict[str, list[dict[str, Any]]]:
        per_host: dict[str, list[dict[str, Any]]] = {}
        for item in items:
            if item.get(key) not in self.placement:
                raise NotFound(f"no node {item.get(key)!r} in this experiment")
            per_host.setdefault(self.placement[item[key]], []).append(item)
        return per_host

    # bring-up ----------------------------------------------------------------------------------
    def check_hosts(self) -> dict[str, dict[str, Any]]:
        """Every host's capabilities; each agent must run the runtime the hosts file says."""
        caps = self._each(lambda name, w: w.capabilities())
        for name, cap in caps.items():
            want = self.hosts.hosts[name].runtime
            if cap.get("runtime") != want:
                raise ConfigError(f"host {name}: its agent makes {cap.get('runtime')} nodes, the hosts file says "
                                  f"{want}: restart it with --runtime {want}")
            if name in self.hosts.swarm:
                if not (cap.get("docker") or {}).get("available"):
                    raise ConfigError(f"host {name}: its agent has no usable Docker engine: "
                                      f"{(cap.get('docker') or {}).get('problem')}")
            elif want != "physical" and cap.get("subnet"):
                self._subnets[name] = cap["subnet"]
        seen: dict[str, str] = {"the swarm overlay": self.hosts.overlay_subnet} if self.hosts.swarm else {}
        for name, subnet in self._subnets.items():
            for other, taken in seen.items():
                if ipaddress.IPv4Network(subnet).overlaps(ipaddress.IPv4Network(taken)):
                    raise ConfigError(f"{other} and host {name} use overlapping node subnets {taken} and {subnet}: "
                                      "give each agent its own --subnet, apart from the overlay")
            seen[f"host {name}"] = subnet
        return caps

    def sync_code(self, url: str, token: str, progress: Progress) -> None:
        """Give every agent the controller's dml_app/ and dataset/ (NFS mount or HTTP fetch); a
        loopback agent fetches from the loopback address (its nodes' bridge is not up yet).
        The manifest (each file's sha256) goes to the agent in the sync call itself, over its
        pinned TLS channel: a file fetched from ``url``, or copied out of an NFS share, is kept
        only if it matches, and the agent checks its code against it again before importing it
        as root."""
        from controller.workers.files import manifest

        agents = [h.name for h in self.hosts.hosts.values() if h.agent is not None]
        loopback = urlunsplit(urlsplit(url)._replace(netloc=f"127.0.0.1:{urlsplit(url).port}"))
        # an NFS host gets the hashes too: it copies the code out of its share, checked
        files = manifest(self.trees, TREES) if self.trees is not None and agents else None

        def one(name: str, worker: Worker) -> Any:
            host = self.hosts.hosts[name]
            if host.nfs:
                return worker.sync({"version": 1, "nfs": host.nfs, "manifest": files})
            return worker.sync({"version": 1, "url": loopback if host.local else url, "token": token,
                                "manifest": files})

        for name, result in self._each(one, agents).items():
            how = f"mounted {result.get('export')}" if result["method"] == "nfs" else \
                f"{result['fetched']} files fetched ({result['bytes']} bytes), {result['unchanged']} unchanged"
            progress(f"host {name}: code and data synced: {how}")

    def install_routes(self) -> None:
        """Routes between the routed hosts' node subnets; with a swarm fabric, the routed hosts
        reach the overlay via the controller's machine, which forwards to its gateway."""
        swarm = set(self.hosts.swarm)
        lan = {h.name: self.controller_ip if h.local else h.ip or self.controller_ip for h in self.hosts.hosts.values()
               if h.name not in swarm or h.local}
        local = next((h.name for h in self.hosts.hosts.values() if h.local), None)
        requests = plan_routes(self._subnets, lan, self.controller_ip, local)
        if self.fabric is not None:
            if not self._subnets and not any(self.hosts.hosts[h].runtime == "physical" for h in lan):
                return  # every node is on the overlay
            for stack, request in requests.items():  # the overlay is a peer everywhere (Docker's FORWARD drops)
                request["peers"].append(self.hosts.overlay_subnet)
                if stack != local and stack is not None:
                    request["routes"].append({"subnet": self.hosts.overlay_subnet, "via": self.controller_ip})
        self._each(lambda name, w: w.set_routes(requests[name]), [h for h in requests if h is not None])
        if None in requests:
            self.controller_stack.set_routes(requests[None])

    # the Worker protocol --------------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        caps = self.check_hosts()
        for name in self.hosts.swarm:  # their nodes live in the overlay (isolation drops it whole)
            caps[name] = {**caps[name], "subnet": self.hosts.overlay_subnet}
        versions = [c.get("cgroup_version") for n, c in caps.items() if self.hosts.hosts[n].emulator]
        return {"version": 1, "netem": all(c.get("netem") for c in caps.values()),
                "cgroup_version": min(versions) if versions and all(versions) else None,
                "kernel": ", ".join(sorted({str(c.get("kernel")) for c in caps.values()})), "hosts": caps}

    def create_nodes(self, body: Any) -> dict[str, Any]:
        """Create every host's nodes in parallel, then route between the hosts; with a swarm
        fabric, bring the fabric up first and give its hosts' nodes their overlay addresses."""
        if self.fabric is not None:
            on_overlay = [n["name"] for n in body["nodes"] if self.placement.get(n["name"]) in self.hosts.swarm]
            ips = node_addresses(on_overlay, self.hosts.overlay_subnet)
            body = {**body, "nodes": [{**n, "ip": ips[n["name"]]} if n["name"] in ips else n for n in body["nodes"]]}
            devices = sorted(f"{n['ip']}/32" for n in body["nodes"] if n.get("ip") and n["name"] not in ips)
            self.fabric.up(self.workers, sorted(self._subnets.values()) + devices, self.progress)
        per_host = self._split(body["nodes"], "name")
        created = self._each(lambda name, w: w.create_nodes({"version": 1, "nodes": per_host[name]}), list(per_host))
        self.install_routes()
        by_name = {n["name"]: {**n, "host": host} for host, r in created.items() for n in r["nodes"]}
        warnings = [f"host {host}: {w}" for host, r in created.items() for w in r.get("warnings", [])]
        return {"version": 1, "nodes": [by_name[n["name"]] for n in body["nodes"]],
                **({"warnings": warnings} if warnings else {})}

    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]:
        per_host = self._split(body["links"], "src")
        unshaped = self._split([{"node": n, "peers": p} for n, p in body.get("unshaped", {}).items()], "node")
        access = self._split([{"node": n, "sides": a} for n, a in body.get("access", {}).items()], "node")
        extra = {"isolation": body["isolation"]} if "isolation" in body else {}

        def one(name: str, w: Worker) -> Any:
            mine = {u["node"]: u["peers"] for u in unshaped.get(name, [])}
            my_access = {a["node"]: a["sides"] for a in access.get(name, [])}
            return w.set_links({"version": 1, "links": per_host.get(name, []), **extra,
                                **({"unshaped": mine} if mine else {}),
                                **({"access": my_access} if my_access else {})}, merge)

        done = self._each(one, list(dict.fromkeys([*per_host, *unshaped, *access])))
        return {"version": 1, "nodes": [n for r in done.values() for n in r["nodes"]],
                "seconds": max((r.get("seconds", 0) for r in done.values()), default=0)}

    def set_rates(self, body: Any) -> dict[str, Any]:
        """Each host's links' new rates, to every host at once (one request each)."""
        per_host = self._split(body["rates"], "src")
        done = self._each(lambda name, w: w.set_rates({"version": 1, "rates": per_host[name]}), list(per_host))
        return {"version": 1, "links": sum(r["links"] for r in done.values()),
                "seconds": max((r.get("seconds", 0) for r in done.values()), default=0)}

    def schedule_start(self, body: Any) -> dict[str, Any]:
        """Each host its links' bins, one common start (wall clock), to every host at once."""
        per_host = self._split(body["links"], "src")
        done = self._each(lambda name, w: w.schedule_start({**body, "links": per_host[name]}), list(per_host))
        return {"version": 1, "links": sum(r["links"] for r in done.values()),
                "starts_in_s": min((r["starts_in_s"] for r in done.values()), default=0)}

    def schedule_end(self, body: Any) -> dict[str, Any]:
        per_host = self._split([x for x in body["links"] if x.get("src") in self.placement], "src")
        done = self._each(lambda name, w: w.schedule_end({"version": 1, "links": per_host[name]}), list(per_host))
        return {"version": 1, "ended": [x for r in done.values() for x in r["ended"]]}

    def schedule_stop(self) -> dict[str, Any]:
        """Every host's clock stopped: the hosts' ticks (each row with its ``host``) and bins."""
        done = self._each(lambda name, w: w.schedule_stop())
        return {"version": 1, "running": any(r["running"] for r in done.values()),
                "links": sum(r["links"] for r in done.values()),
                "rows": [{**row, "host": name} for name, r in done.items() for row in r["rows"]],
                "applied": [x for r in done.values() for x in r["applied"]],
                "stopped_hosts": sorted(name for name, r in done.items() if not r["running"])}

    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]:
        if node is not None:
            return self._worker_of(node).clear_links(node)
        done = self._each(lambda name, w: w.clear_links())
        return {"version": 1, "cleared": [n for r in done.values() for n in r["cleared"]]}

    def fault(self, body: Any) -> dict[str, Any]:
        """Scenario changes, each sent to its node's host."""
        per_host = self._split(body["faults"], "node")
        done = self._each(lambda name, w: w.fault({"version": 1, "faults": per_host[name]}), list(per_host))
        return {"version": 1, "results": [x for r in done.values() for x in r["results"]]}

    def processes(self) -> dict[str, Any]:
        done = self._each(lambda name, w: w.processes())
        return {"version": 1, "processes": [p for r in done.values() for p in r["processes"]]}

    def status(self) -> dict[str, Any]:
        done = self._each(lambda name, w: w.status())
        return {"version": 1, "bridge_ip": self.controller_ip,
                "nodes": [{**n, "host": host} for host, r in done.items() for n in r["nodes"]],
                "hosts": {host: {k: r.get(k) for k in ("runtime", "subnet", "routes", "testbed_id")}
                          for host, r in done.items()}}

    def reset(self) -> dict[str, Any]:
        """Reset every host (all are tried, even when one fails) and the controller's routes."""
        removed: dict[str, Any] = {}
        failed: dict[str, TestbedError] = {}
        for name, worker in self.workers.items():
            try:
                removed[name] = worker.reset().get("removed")
            except TestbedError as e:
                removed[name], failed[name] = {"error": e.message}, e
        if self.controller_stack not in self.workers.values():
            try:
                removed["controller"] = self.controller_stack.reset().get("removed")
            except TestbedError as e:
                removed["controller"], failed["controller"] = {"error": e.message}, e
        if self.fabric is not None:
            try:
                removed["swarm"] = self.fabric.down()
            except TestbedError as e:
                removed["swarm"], failed["swarm"] = {"error": e.message}, e
        if failed:  # the others were reset; the caller can retry for these
            first = next(iter(failed.values()))
            raise type(first)("reset failed on " + "; ".join(f"{n}: {e.message}" for n, e in failed.items()),
                              detail={"removed": removed})
        return {"version": 1, "removed": removed}

    def set_routes(self, body: Any) -> dict[str, Any]:
        raise ConfigError("a cluster routes between its hosts itself (install_routes): give each host its own routes")

    def set_fabric(self, body: Any) -> dict[str, Any]:
        raise ConfigError("a cluster joins each Docker host to its swarm itself (controller.workers.swarm)")

    def swarm_probe(self, body: Any) -> dict[str, Any]:
        """Each host's swarm facts (``worker.swarm_probe``), by host name; read-only."""
        return {"version": 1, "hosts": self._each(lambda name, w: w.swarm_probe(body))}

    def sync(self, body: Any) -> dict[str, Any]:
        raise ConfigError("a cluster syncs each host with its own request (sync_code)")

    def telemetry_start(self, body: Any) -> dict[str, Any]:
        """Start every host's sampler; the samples are read host by host (``workers``)."""
        done = self._each(lambda name, w: w.telemetry_start(body))
        return {"version": API_VERSION, "hosts": done}

    def telemetry_read(self, cursor: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        raise ConfigError("a cluster's telemetry is read host by host, each from its own cursor: read its workers")

    def telemetry_stop(self) -> dict[str, Any]:
        done = self._each(lambda name, w: w.telemetry_stop())
        return {"version": API_VERSION, "hosts": done}


for _op in OPERATIONS.values():  # the per-node operations (shaping, exec, processes, captures), by the table
    if _op.per_node:
        setattr(Cluster, _op.name, _on_node_host(_op.name))
del _op
