"""The worker API as both sides speak it: its version, shared constants, and every operation once.

``OPERATIONS`` is the one declaration of the agent's REST API: each operation's name (the
``Worker`` method that performs it, and the agent's endpoint), HTTP method and path, the
largest request body it takes, whether a client may repeat it after a connection error
(idempotent: it leaves the same state however often it runs), its success status and whether
the worker's method takes the request's JSON body (after the path's parameters).
``worker.agent`` builds its routes and body limits from it (a client retries the idempotent ones);
``controller.workers.agent_client`` builds its calls from it; ``controller.workers.cluster``
forwards the per-node operations by it.

Requests carry ``"version": API_VERSION`` (``check_version``); answers do too.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from worker.api.errors import ConfigError

API_VERSION = 1

# the node network -------------------------------------------------------------------------------
DEFAULT_SUBNET = "10.77.0.0/16"  # an emulator host's node subnet unless told otherwise
NODE_IFNAME = "eth0"  # the interface a node's links leave by


def node_address(subnet: ipaddress.IPv4Network, index: int) -> str:
    """The address of the node created ``index``-th (0-based): the bridge has the first one."""
    if index + 2 >= subnet.num_addresses - 1:
        raise ConfigError(f"subnet {subnet} has no room for node number {index + 1}")
    return str(subnet.network_address + 2 + index)


# telemetry and code sync ----------------------------------------------------------------------------
MIN_PERIOD_MS = 10  # telemetry sampling period bounds
MAX_PERIOD_MS = 10_000
DEFAULT_PERIOD_MS = 100
MIN_PIDS_MAX = 16  # bounds of a node's process and thread limit
MAX_PIDS_MAX = 4_194_304  # the kernel's largest pid
TREES = ("dml_app", "dataset", "dml_user")  # the directories a worker syncs from the controller (dml_user: the
#                                             user's own code, staged by the controller)

# node processes ------------------------------------------------------------------------------------
PRELOAD_ENV = "EDGETB_PRELOAD"  # in a start_node request's env: what the host's zygote preloads for the node
#                                 (comma-separated, of worker.confinement.zygote.PRELOADS)
FLOWER_PRELOADS = ("torch",)  # what the Flower fork server may import ahead beyond flwr and numpy (of the
#                              app's declared dependencies; worker.confinement.flower_forks)

# request bodies ------------------------------------------------------------------------------------
MAX_REQUEST_BYTES = 16 * 1024 * 1024  # whole networks: nodes, links, code manifests
MEDIUM_REQUEST_BYTES = 1024 * 1024  # a command line with its environment, a route table
SMALL_REQUEST_BYTES = 64 * 1024  # every other operation


def ifname(node: dict[str, Any]) -> str:
    """The interface a node's links leave by (recorded by its runtime, else ``NODE_IFNAME``)."""
    return node.get("ifname") or NODE_IFNAME


def check_version(body: Any) -> dict[str, Any]:
    """A request body: a JSON object of this API's version (ConfigError otherwise)."""
    if not isinstance(body, dict):
        raise ConfigError("request body must be a JSON object")
    if body.get("version") != API_VERSION:
        raise ConfigError(f"request version must be {API_VERSION}, got {body.get('version')!r}")
    return body


NODE_SEGMENT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
PATH_PARAM_RE = re.compile(r"<([a-z_]+)>")


@dataclass(frozen=True)
class Operation:
    """One operation of the worker API. A ``<name>`` in the path is a node's name; the
    operation then concerns that node only (a cluster sends it to the node's host)."""

    name: str
    method: str
    path: str
    limit_bytes: int = SMALL_REQUEST_BYTES
    idempotent: bool = False
    status: int = 200
    body: bool = False  # the worker's method takes the request's JSON body, after the path's parameters

    @property
    def params(self) -> tuple[str, ...]:
        """The path's parameters, in order."""
        return tuple(PATH_PARAM_RE.findall(self.path))

    @property
    def per_node(self) -> bool:
        return self.params[:1] == ("name",)

    def url_path(self, **values: str) -> str:
        """The path with its parameters filled in, each one path segment (ConfigError when a
        value could be more: a node name must be one, ``/`` and dot segments are refused)."""
        if set(values) != set(self.params):
            raise ValueError(f"{self.name}: path parameters {self.params}, given {sorted(values)}")

        def segment(match: re.Match) -> str:
            key = match.group(1)
            value = values[key]
            if key == "name" and not (isinstance(value, str) and NODE_SEGMENT_RE.fullmatch(value)):
                raise ConfigError(f"{value!r} is not a node name")
            if not isinstance(value, str) or value in ("", ".", "..") or "/" in value:
                raise ConfigError(f"{self.name}: {value!r} is not a valid {key}")
            return quote(value, safe="")

        return PATH_PARAM_RE.sub(segment, self.path)


def _table(*operations: Operation) -> dict[str, Operation]:
    table = {op.name: op for op in operations}
    if len(table) != len(operations) or len({(op.method, op.path) for op in operations}) != len(operations):
        raise ValueError("an operation is declared twice")
    return table


OPERATIONS: dict[str, Operation] = _table(
    # the host
    Operation("health", "GET", "/health", idempotent=True),  # the only call without the token
    Operation("capabilities", "GET", "/capabilities", idempotent=True),
    Operation("status", "GET", "/status", idempotent=True),
    Operation("reset", "POST", "/reset", idempotent=True),
    Operation("sync", "POST", "/sync", MAX_REQUEST_BYTES, idempotent=True, body=True),
    Operation("set_routes", "PUT", "/routes", MEDIUM_REQUEST_BYTES, idempotent=True, body=True),
    Operation("set_fabric", "PUT", "/fabric", idempotent=True, body=True),  # join the swarm fabric (worker.nodes.docker_swarm)
    Operation("swarm_probe", "POST", "/swarm/probe", idempotent=True, body=True),  # read-only (worker.swarm_probe)
    # nodes and links
    Operation("create_nodes", "POST", "/nodes", MAX_REQUEST_BYTES, idempotent=True, status=201, body=True),
    Operation("set_links", "PUT", "/links", MAX_REQUEST_BYTES, idempotent=True, body=True),
    Operation("merge_links", "PATCH", "/links", MAX_REQUEST_BYTES, idempotent=True, body=True),  # set_links(merge=True)
    Operation("clear_links", "DELETE", "/links", idempotent=True),
    Operation("set_rates", "PATCH", "/links/rates", MAX_REQUEST_BYTES, idempotent=True, body=True),  # rates only
    # a trace's bins ticked by the host's clock (worker.shaping.schedule)
    Operation("schedule_start", "PUT", "/links/schedule", MAX_REQUEST_BYTES, idempotent=True, body=True),
    Operation("schedule_end", "PATCH", "/links/schedule", MEDIUM_REQUEST_BYTES, idempotent=True, body=True),
    Operation("schedule_stop", "DELETE", "/links/schedule"),  # (not repeated: its ticks are answered once)
    Operation("shaping", "GET", "/nodes/<name>/shaping", idempotent=True),
    Operation("fault", "POST", "/faults", body=True),
    # processes in nodes
    Operation("exec", "POST", "/nodes/<name>/exec", MEDIUM_REQUEST_BYTES, body=True),
    Operation("start_process", "POST", "/nodes/<name>/processes", MEDIUM_REQUEST_BYTES, status=201, body=True),
    Operation("start_node", "POST", "/nodes/<name>/app", MEDIUM_REQUEST_BYTES, status=201, body=True),
    Operation("processes", "GET", "/processes", idempotent=True),
    Operation("stop_process", "DELETE", "/nodes/<name>/processes/<proc_id>", idempotent=True),  # ?offset= (log)
    Operation("process_log", "GET", "/nodes/<name>/processes/<proc_id>/log", idempotent=True),  # ?offset=&limit=
    # observation
    Operation("telemetry_start", "POST", "/telemetry/start", body=True),
    Operation("telemetry_read", "GET", "/telemetry", idempotent=True),
    Operation("telemetry_stop", "POST", "/telemetry/stop", idempotent=True),
    Operation("start_capture", "POST", "/nodes/<name>/capture", status=201, body=True),
    Operation("stop_capture", "DELETE", "/nodes/<name>/capture", idempotent=True),
    Operation("remove_capture", "DELETE", "/nodes/<name>/capture.pcap", idempotent=True),
    Operation("capture_chunks", "GET", "/nodes/<name>/capture.pcap", idempotent=True),  # a stream of bytes
)
