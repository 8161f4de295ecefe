"""Talking to worker agents: over HTTP, or in-process on a single host.

``AgentClient`` has the same methods as ``worker.host.WorkerHost`` (the in-process
worker), so the CLI and the controller drive either one. HTTP errors become the
testbed's exceptions here, in one place.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

import requests

from worker import errors

_ERRORS_BY_CODE = {cls.code: cls for cls in (
    errors.ConfigError, errors.TopologyError, errors.CapabilityError, errors.ShapingError,
    errors.NodeRuntimeError, errors.NotFound, errors.AuthError, errors.AgentUnreachable, errors.TestbedTimeout)}


class Worker(Protocol):
    """What the controller needs of a worker host (WorkerHost or AgentClient)."""

    def capabilities(self) -> dict[str, Any]: ...
    def create_nodes(self, body: Any) -> dict[str, Any]: ...
    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]: ...
    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]: ...
    def shaping(self, node: str) -> dict[str, Any]: ...
    def exec(self, node: str, body: Any) -> dict[str, Any]: ...
    def start_process(self, node: str, body: Any) -> dict[str, Any]: ...
    def start_node(self, node: str, body: Any) -> dict[str, Any]: ...
    def set_routes(self, body: Any) -> dict[str, Any]: ...
    def sync(self, body: Any) -> dict[str, Any]: ...
    def processes(self) -> dict[str, Any]: ...
    def stop_process(self, node: str, proc_id: str) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...
    def reset(self) -> dict[str, Any]: ...


class AgentClient:
    """A worker agent reached over HTTP with its bearer token."""

    def __init__(self, url: str, token: str, timeout_s: float = 300.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self.session.headers["Authorization"] = f"Bearer {token}"

    def _call(self, method: str, path: str, body: Any = None, params: Optional[dict] = None) -> dict[str, Any]:
        try:
            resp = self.session.request(method, self.url + path, json=body, params=params, timeout=self.timeout_s)
        except requests.Timeout:
            raise errors.TestbedTimeout(f"agent {self.url} did not answer {method} {path} within {self.timeout_s:g}s") from None
        except requests.RequestException as e:
            raise errors.AgentUnreachable(f"agent {self.url} is unreachable: {e}") from None
        try:
            data = resp.json()
        except ValueError:
            raise errors.AgentUnreachable(f"agent {self.url} answered {resp.status_code} without JSON") from None
        if resp.status_code >= 400:
            cls = _ERRORS_BY_CODE.get(data.get("error"), errors.TestbedError)
            raise cls(str(data.get("message") or data.get("detail")), detail=data.get("detail"))
        return data

    def health(self) -> dict[str, Any]:
        return self._call("GET", "/health")

    def capabilities(self) -> dict[str, Any]:
        return self._call("GET", "/capabilities")

    def create_nodes(self, body: Any) -> dict[str, Any]:
        return self._call("POST", "/nodes", body)

    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]:
        return self._call("PATCH" if merge else "PUT", "/links", body)

    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]:
        return self._call("DELETE", "/links", params={"node": node} if node else None)

    def shaping(self, node: str) -> dict[str, Any]:
        return self._call("GET", f"/nodes/{node}/shaping")

    def exec(self, node: str, body: Any) -> dict[str, Any]:
        return self._call("POST", f"/nodes/{node}/exec", body)

    def start_process(self, node: str, body: Any) -> dict[str, Any]:
        return self._call("POST", f"/nodes/{node}/processes", body)

    def start_node(self, node: str, body: Any) -> dict[str, Any]:
        return self._call("POST", f"/nodes/{node}/app", body)

    def set_routes(self, body: Any) -> dict[str, Any]:
        return self._call("PUT", "/routes", body)

    def sync(self, body: Any) -> dict[str, Any]:
        return self._call("POST", "/sync", body)

    def processes(self) -> dict[str, Any]:
        return self._call("GET", "/processes")

    def stop_process(self, node: str, proc_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/nodes/{node}/processes/{proc_id}")

    def status(self) -> dict[str, Any]:
        return self._call("GET", "/status")

    def reset(self) -> dict[str, Any]:
        return self._call("POST", "/reset", {"version": 1})
