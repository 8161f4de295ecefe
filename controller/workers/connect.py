"""``connect``: the one place that makes workers (``controller.workers.api.Worker``), and the
readings and clean-ups that need to know which kind a worker is."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from controller.workers.api import Worker
from worker.api.errors import ConfigError
from worker.api.protocol import DEFAULT_SUBNET

if TYPE_CHECKING:
    from controller.model.hosts import Hosts


def connect(testbed_id: str = "0", subnet: str = DEFAULT_SUBNET, *, agent: Optional[str] = None,
            token: Optional[str] = None, fingerprint: Optional[str] = None, name: Optional[str] = None,
            runtime: Optional[str] = None, workdir: Optional[str] = None, code_root: Optional[str] = None,
            runtime_options: Optional[dict[str, Any]] = None, hosts: Optional["Hosts"] = None,
            placement: Optional[dict[str, str]] = None) -> Worker:
    """The worker of testbed ``testbed_id``:

    - with ``hosts`` (a hosts file) and ``placement`` (node -> host): the ``Cluster`` of those
      hosts, an agent for each host that has one (its token from its ``token_file``), this
      host in process for the one without;
    - with ``agent`` (its URL), ``token`` and ``fingerprint`` (its pinned certificate): that agent;
    - else this host in process, making ``runtime`` nodes in ``subnet`` (default: the kind its
      existing nodes are), running the code of ``code_root`` with ``workdir`` as their
      experiment directory.
    """
    if hosts is not None:
        return _cluster(hosts, placement or {}, testbed_id, subnet, workdir, code_root, runtime_options)
    if agent is not None:
        from controller.workers.agent_client import AgentClient

        if token is None:
            raise ValueError("an agent needs its token")
        return AgentClient(agent, token, name=name, fingerprint=fingerprint)
    from worker.host import WorkerHost

    return WorkerHost(testbed_id, subnet, runtime=runtime, workdir=workdir, code_root=code_root,
                      runtime_options=runtime_options)


def _cluster(hosts: "Hosts", placement: dict[str, str], testbed_id: str, subnet: str, workdir: Optional[str],
             code_root: Optional[str], runtime_options: Optional[dict[str, Any]]) -> Worker:
    from controller.workers.cluster import Cluster, agent_tokens, controller_ip_of
    from worker.host import REPO_ROOT

    code_root = code_root or REPO_ROOT
    tokens = agent_tokens(hosts)
    workers: dict[str, Worker] = {}
    in_process = None
    for host in hosts.hosts.values():
        if host.agent is None:
            in_process = workers[host.name] = connect(
                testbed_id, subnet, runtime=host.runtime, workdir=workdir, code_root=code_root,
                runtime_options=runtime_options if host.runtime == "docker" else None)
        else:
            workers[host.name] = connect(agent=host.agent, token=tokens[host.name], name=host.name,
                                         fingerprint=host.tls_fingerprint)
    controller_ip = controller_ip_of(hosts, workers, in_process is not None)
    local = next((h.name for h in hosts.hosts.values() if h.local), None)
    # the controller's own routes go through the worker of the host sharing its machine, or this host's
    stack = workers[local] if local else connect(testbed_id, subnet)
    cluster = Cluster(hosts, placement, workers, stack, controller_ip)
    cluster.tokens = tokens
    if hosts.engine == "swarm":
        from controller.model.hosts import ENCRYPTED_REFUSAL
        from controller.workers.swarm import SwarmFabric

        if hosts.overlay_encrypted:
            raise ConfigError(f"hosts file, field 'overlay_encrypted': {ENCRYPTED_REFUSAL}")
        cluster.fabric = SwarmFabric(hosts, testbed_id, controller_ip)
    cluster.trees = {"dml_app": code_root, "dataset": workdir or "", "dml_user": workdir or ""}
    return cluster


def recorded_plans(worker: Worker) -> dict[str, Optional[dict[str, Any]]]:
    """Each node's shaping plan (``Plan.to_dict``, None when unshaped) on the hosts of ``worker``:
    a host in this process reads its state, an agent is asked node by node."""
    from worker.host import WorkerHost

    plans: dict[str, Optional[dict[str, Any]]] = {}
    for w in worker.workers.values():
        if isinstance(w, WorkerHost):
            state = w.store.read()  # (what its status() reads, without asking after its processes)
            plans.update({name: state["plans"].get(name) for name in state["nodes"]})
        else:
            plans.update({n["name"]: w.shaping(n["name"])["plan"] if n.get("shaped") else None
                          for n in w.status()["nodes"]})
    return plans


def reset_stale(testbed_id: str, subnet: str, found: Any, runtime: Optional[str] = None) -> dict[str, Any]:
    """Remove what a dead holder of ``testbed_id`` (``found``, controller.workers.lock) left on this
    host: in its recorded subnet, nodes of the kind the state file records (else ``runtime``).
    Returns the reset's ``removed``."""
    recorded = (found.holder.details if found.holder else {}).get("subnet") or subnet
    return connect(testbed_id, str(recorded), runtime=runtime).reset()["removed"]
