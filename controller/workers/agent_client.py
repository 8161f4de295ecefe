"""Talking to a worker agent over HTTPS (or loopback HTTP).

``AgentClient`` is a ``Worker`` (controller.workers.api), like ``worker.host.WorkerHost``
(the in-process worker), so the CLI and the controller drive either one. HTTP errors become
the testbed's exceptions here, in one place, with messages that name the host and the call.

Transport: an agent on another machine is reached over HTTPS, its certificate pinned by
its SHA-256 fingerprint (hosts.json ``tls_fingerprint``); plain ``http://`` is refused but on
loopback. On loopback the listening socket must belong to root (read from the kernel's
socket table) before the token is sent: another local user cannot pose as the agent.
Every call is an operation of ``worker.api.protocol.OPERATIONS``; those it declares idempotent
(every GET too) are retried on connection errors, with backoff.
"""
from __future__ import annotations

import errno
import http.client
import socket
import ssl
import time
import warnings
from typing import Any, Callable, Iterator, Optional
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter

from worker.api import errors
from worker.api.peers import is_loopback_host, normalize_fingerprint
from worker.api.protocol import API_VERSION, OPERATIONS

# a loopback agent without a pinned certificate is authenticated by who owns its socket instead
warnings.filterwarnings("ignore", message=r"Unverified HTTPS request is being made to host "
                                          r"'(127\.\d+\.\d+\.\d+|localhost|::1)'")

_ERRORS_BY_CODE = {cls.code: cls for cls in (
    errors.ConfigError, errors.TopologyError, errors.CapabilityError, errors.ShapingError,
    errors.NodeRuntimeError, errors.NotFound, errors.AuthError, errors.AgentUnreachable, errors.TestbedTimeout)}
_ERRORS_BY_STATUS = {400: errors.ConfigError, 401: errors.AuthError, 403: errors.AuthError, 404: errors.NotFound,
                     413: errors.ConfigError, 422: errors.CapabilityError, 502: errors.AgentUnreachable,
                     504: errors.TestbedTimeout}
_ERRNO_REASONS = {errno.ECONNREFUSED: "connection refused", errno.ECONNRESET: "connection reset",
                  errno.EHOSTUNREACH: "no route to host", errno.ENETUNREACH: "network unreachable",
                  errno.ETIMEDOUT: "connection timed out", errno.ECONNABORTED: "connection aborted",
                  errno.EPIPE: "connection closed"}
DEFAULT_TRIES = 3
DEFAULT_BACKOFF_S = 0.5
DEFAULT_CONNECT_TIMEOUT_S = 10.0


class _PinnedAdapter(HTTPAdapter):
    """HTTPS whose server certificate must have one SHA-256 fingerprint (no CA involved)."""

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        super().__init__()

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        kwargs["assert_fingerprint"] = self.fingerprint
        super().init_poolmanager(*args, **kwargs)

    def cert_verify(self, conn: Any, url: str, verify: Any, cert: Any) -> None:
        super().cert_verify(conn, url, False, cert)
        conn.assert_fingerprint = self.fingerprint


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and every exception behind it (arguments, reasons, causes, contexts), once each."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop(0)
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [*getattr(e, "args", ()), getattr(e, "reason", None), e.__cause__, e.__context__]


def connection_problem(exc: BaseException) -> str:
    """What went wrong with a connection, in a few words (never the HTTP library's own text)."""
    for e in _chain(exc):
        if isinstance(e, socket.gaierror):
            return "name not resolved"
        if isinstance(e, OSError) and e.errno in _ERRNO_REASONS:
            return _ERRNO_REASONS[e.errno]
        if isinstance(e, ConnectionRefusedError):
            return "connection refused"
        if isinstance(e, ConnectionResetError):
            return "connection reset"
        if isinstance(e, (socket.timeout, TimeoutError)):
            return "connection timed out"
        if isinstance(e, http.client.RemoteDisconnected):
            return "the agent closed the connection without answering"
    return "connection failed"


# a record garbled on an established channel: the transport's fault, not the agent's identity (that is
# checked at every handshake); an idempotent call is tried again on a new connection
TRANSIENT_TLS = ("DECRYPTION_FAILED_OR_BAD_RECORD_MAC", "BAD_RECORD_MAC")


def _ssl_reason(exc: BaseException) -> Optional[str]:
    for e in _chain(exc):
        if isinstance(e, ssl.SSLError):
            return str(getattr(e, "reason", None) or e.__class__.__name__)
    return None


class AgentClient:
    """A worker agent reached over HTTPS (pinned) or loopback HTTP, with its bearer token."""

    def __init__(self, url: str, token: str, timeout_s: float = 300.0, name: Optional[str] = None,
                 fingerprint: Optional[str] = None, tries: int = DEFAULT_TRIES,
                 backoff_s: float = DEFAULT_BACKOFF_S, connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """``timeout_s`` bounds the wait for an answer, ``connect_timeout_s`` each connection
        attempt; an idempotent call is tried ``tries`` times, waiting ``backoff_s``, then twice
        that, ... between tries."""
        from worker.serving import check_token

        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self.name = name or parts.hostname or self.url
        self.label = f"agent {self.name} ({self.url})"
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise errors.ConfigError(f"{self.label}: not an agent URL such as https://10.254.0.2:3334")
        self.timeout_s = timeout_s
        self.connect_timeout_s = min(connect_timeout_s, timeout_s)
        self.tries = max(1, tries)
        self.backoff_s = backoff_s
        self.loopback = is_loopback_host(parts.hostname or "")
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.fingerprint = normalize_fingerprint(fingerprint, f"{self.label}: tls_fingerprint") if fingerprint else None
        if parts.scheme == "http" and not self.loopback:
            raise errors.ConfigError(f"{self.label}: plain http is refused for an agent on another machine (the token "
                                     "gives root there): use https:// and pin its certificate with tls_fingerprint")
        if parts.scheme == "https" and not self.fingerprint and not self.loopback:
            raise errors.ConfigError(f"{self.label}: no tls_fingerprint: run 'python3 -m worker.agent "
                                     f"--print-fingerprint' on host {self.name} and give it in the hosts file")
        self.session = requests.Session()
        self.session.trust_env = False  # no proxy, CA bundle or netrc from the environment: the agent directly
        self.session.headers["Authorization"] = f"Bearer {check_token(token, f'the token of {self.label}')}"
        if parts.scheme == "https":
            # no CA: the certificate is pinned, or on loopback the socket's owner is checked instead
            self.session.verify = False
        if self.fingerprint:
            self.session.mount("https://", _PinnedAdapter(self.fingerprint))

    is_local = False  # the agent's host is reached over the network: its state and clock are its own

    @property
    def workers(self) -> dict[str, "AgentClient"]:
        return {self.name: self}

    def _check_listener(self) -> None:
        """On loopback, the agent's port must be held by root before the token goes there."""
        if not self.loopback or self.fingerprint:
            return
        from worker.sockets import listener_uid

        host = urlsplit(self.url).hostname or "127.0.0.1"
        uid = listener_uid("127.0.0.1" if host == "localhost" else host, self.port)
        if uid not in (None, 0):
            raise errors.AuthError(f"{self.label}: port {self.port} is held by a process of uid {uid}, not root: "
                                   "refusing to send it the agent's token")

    def _tls_problem(self, method: str, path: str, exc: BaseException) -> errors.TestbedError:
        where = f"{self.label}: {method} {path}"
        if self.fingerprint and "fingerprint" in str(exc).lower():
            try:
                host = urlsplit(self.url).hostname or ""
                seen = ssl.get_server_certificate((host, self.port), timeout=5)
                from worker.tls import fingerprint_der, pretty

                actual = f"has fingerprint {pretty(fingerprint_der(ssl.PEM_cert_to_DER_cert(seen)))}"
            except (OSError, ValueError, TypeError):
                actual = "has another fingerprint"
            from worker.tls import pretty

            return errors.AuthError(f"{where}: the agent's TLS certificate {actual}, but the hosts file pins "
                                    f"{pretty(self.fingerprint)} for host {self.name}: another machine answers, or "
                                    f"the agent's certificate was remade (then run 'python3 -m worker.agent "
                                    f"--print-fingerprint' on {self.name} and update tls_fingerprint)")
        reason = _ssl_reason(exc) or "handshake failed"
        hint = " (is the agent serving plain http? use an http:// URL for a loopback --plain-http agent)" \
            if "WRONG_VERSION_NUMBER" in reason.upper() else ""
        return errors.AgentUnreachable(f"{where}: TLS handshake failed: {reason}{hint}")

    def _op(self, operation: str, /, body: Any = None, params: Optional[dict] = None,
            **segments: str) -> dict[str, Any]:
        """``operation`` of the worker API (worker.api.protocol), its path filled with ``segments``."""
        op = OPERATIONS[operation]
        return self._call(op.method, op.url_path(**segments), body, params, op.idempotent)

    def _call(self, method: str, path: str, body: Any, params: Optional[dict], idempotent: bool) -> dict[str, Any]:
        """One call; an idempotent one (the operation table says which) is tried again when the
        agent cannot be reached."""
        tries = self.tries if idempotent else 1
        where = f"{self.label}: {method} {path}"
        for attempt in range(1, tries + 1):
            self._check_listener()
            try:
                resp = self.session.request(method, self.url + path, json=body, params=params,
                                            timeout=(self.connect_timeout_s, self.timeout_s))
                break
            except requests.exceptions.SSLError as e:
                if attempt == tries or (_ssl_reason(e) or "").upper() not in TRANSIENT_TLS:
                    raise self._tls_problem(method, path, e) from None
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            except requests.ConnectionError as e:  # ConnectTimeout too: nothing was sent
                problem = connection_problem(e)
                if isinstance(e, requests.exceptions.ConnectTimeout):
                    problem = "connection timed out"
                if attempt == tries:
                    after = f" after {tries} tries" if tries > 1 else ""
                    hint = " (is the agent serving https? then give an https:// URL)" \
                        if self.url.startswith("http:") and ("closed" in problem or "reset" in problem) else ""
                    raise errors.AgentUnreachable(f"{where}: {problem}{after}{hint}") from None
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            except requests.Timeout:
                raise errors.TestbedTimeout(f"{where}: no answer within {self.timeout_s:g}s") from None
            except requests.RequestException as e:
                raise errors.AgentUnreachable(f"{where}: {connection_problem(e)}") from None
        try:
            data = resp.json()
        except ValueError:
            data = None
        if not isinstance(data, dict):
            raise errors.AgentUnreachable(f"{where}: answered {resp.status_code} without a JSON object (is "
                                          f"{self.url} an edgetb agent?)")
        if resp.status_code >= 400:
            cls = _ERRORS_BY_CODE.get(data.get("error")) or _ERRORS_BY_STATUS.get(resp.status_code, errors.TestbedError)
            message = data.get("message") or data.get("detail") or f"status {resp.status_code}"
            raise cls(f"{where}: {message}", detail=data.get("detail"))
        return data

    # the worker API, one operation each (worker.api.protocol.OPERATIONS) -----------------------------
    def health(self) -> dict[str, Any]:
        return self._op("health")

    def capabilities(self) -> dict[str, Any]:
        return self._op("capabilities")

    def status(self) -> dict[str, Any]:
        return self._op("status")

    def reset(self) -> dict[str, Any]:
        return self._op("reset", {"version": API_VERSION})

    def sync(self, body: Any) -> dict[str, Any]:
        return self._op("sync", body)

    def set_routes(self, body: Any) -> dict[str, Any]:
        return self._op("set_routes", body)

    def set_fabric(self, body: Any) -> dict[str, Any]:
        return self._op("set_fabric", body)

    def swarm_probe(self, body: Any) -> dict[str, Any]:
        """The host's facts for a swarm overlay (``worker.swarm_probe``); changes nothing."""
        return self._op("swarm_probe", body)

    def create_nodes(self, body: Any) -> dict[str, Any]:
        return self._op("create_nodes", body)

    def set_links(self, body: Any, merge: bool = False) -> dict[str, Any]:
        return self._op("merge_links" if merge else "set_links", body)

    def set_rates(self, body: Any) -> dict[str, Any]:
        return self._op("set_rates", body)

    def schedule_start(self, body: Any) -> dict[str, Any]:
        return self._op("schedule_start", body)

    def schedule_end(self, body: Any) -> dict[str, Any]:
        return self._op("schedule_end", body)

    def schedule_stop(self) -> dict[str, Any]:
        return self._op("schedule_stop")

    def clear_links(self, node: Optional[str] = None) -> dict[str, Any]:
        return self._op("clear_links", params={"node": node} if node else None)

    def shaping(self, node: str) -> dict[str, Any]:
        return self._op("shaping", name=node)

    def fault(self, body: Any) -> dict[str, Any]:
        """Scenario changes to nodes (``worker.faults``)."""
        return self._op("fault", body)

    def exec(self, node: str, body: Any) -> dict[str, Any]:
        return self._op("exec", body, name=node)

    def start_process(self, node: str, body: Any) -> dict[str, Any]:
        return self._op("start_process", body, name=node)

    def start_node(self, node: str, body: Any) -> dict[str, Any]:
        return self._op("start_node", body, name=node)

    def processes(self) -> dict[str, Any]:
        return self._op("processes")

    def stop_process(self, node: str, proc_id: str, log_offset: Optional[int] = None) -> dict[str, Any]:
        params = {"offset": str(log_offset)} if log_offset is not None else None
        return self._op("stop_process", params=params, name=node, proc_id=proc_id)

    def process_log(self, node: str, proc_id: str, offset: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        params = {"offset": str(offset)} | ({"limit": str(limit)} if limit is not None else {})
        return self._op("process_log", params=params, name=node, proc_id=proc_id)

    def telemetry_start(self, body: Any) -> dict[str, Any]:
        return self._op("telemetry_start", body)

    def telemetry_read(self, cursor: int = 0, limit: Optional[int] = None) -> dict[str, Any]:
        params = {"cursor": str(cursor)} | ({"limit": str(limit)} if limit is not None else {})
        return self._op("telemetry_read", params=params)

    def telemetry_stop(self) -> dict[str, Any]:
        return self._op("telemetry_stop", {"version": API_VERSION})

    def start_capture(self, node: str, body: Any) -> dict[str, Any]:
        return self._op("start_capture", body, name=node)

    def stop_capture(self, node: str) -> dict[str, Any]:
        return self._op("stop_capture", name=node)

    def remove_capture(self, node: str) -> dict[str, Any]:
        return self._op("remove_capture", name=node)

    def sync_code(self, url: str, token: str, progress: Callable[[str], None]) -> None:
        """Nothing to do for one agent driven on its own: its nodes run the code it has (a
        cluster syncs its agents, ``controller.workers.cluster``)."""

    def capture_chunks(self, node: str) -> Iterator[bytes]:
        """The node's capture file, streamed from the agent in pieces."""
        path = OPERATIONS["capture_chunks"].url_path(name=node)
        where = f"{self.label}: GET {path}"
        self._check_listener()
        try:
            resp = self.session.get(self.url + path, stream=True, timeout=(self.connect_timeout_s, self.timeout_s))
        except requests.exceptions.SSLError as e:
            raise self._tls_problem("GET", path, e) from None
        except requests.RequestException as e:
            raise errors.AgentUnreachable(f"{where}: {connection_problem(e)}") from None
        if resp.status_code >= 400:
            try:
                data = resp.json()
            except ValueError:
                data = {}
            resp.close()
            cls = _ERRORS_BY_CODE.get(data.get("error")) or _ERRORS_BY_STATUS.get(resp.status_code, errors.TestbedError)
            raise cls(f"{where}: {data.get('message') or f'status {resp.status_code}'}")

        def stream() -> Iterator[bytes]:
            try:
                for chunk in resp.iter_content(1 << 20):
                    if chunk:
                        yield chunk
            except requests.RequestException as e:
                raise errors.AgentUnreachable(f"{where}: {connection_problem(e)} while streaming") from None
            finally:
                resp.close()

        return stream()

