"""Serving a Flask app with gevent's WSGI server, with blocking work in real threads.

Nothing is monkey-patched: network-namespace work (setns) must run on real OS
threads, so handlers hand blocking calls to gevent's thread pool.

No caller can lock the others out: every connection is accepted at once and charged to
its caller (``worker.admission``: a local uid, or a source address), which holds a bounded
share; the request head must arrive within ``REQUEST_HEAD_S`` and a TLS handshake within
``TLS_HANDSHAKE_S``, however slowly the bytes trickle.
"""
from __future__ import annotations

import logging
import secrets
import signal
import socket
import ssl
from typing import Any, Callable, Mapping, Optional

from worker.admission import Key, Places, raise_open_files_limit
from worker.api.peers import is_loopback_host

MIN_TOKEN_CHARS = 16
LOCAL_ADDR_KEY = "edgetb.local_addr"  # WSGI environ: (address, port) the connection was accepted on
CALLER_KEY = "edgetb.caller"  # WSGI environ: the caller the connection is charged to (worker.admission.Key)
PLACES_KEY = "edgetb.places"  # WSGI environ: the server's Places
SOCKET_KEY = "edgetb.socket"  # WSGI environ: the connection's socket (a stream watches it for the caller leaving)
BODYLESS_METHODS = ("GET", "HEAD", "DELETE")


def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` in one of gevent's real OS threads; its exception is raised here."""
    import gevent

    def call() -> tuple[bool, Any]:
        try:
            return True, fn(*args)
        except Exception as e:  # handed back to the request's greenlet
            return False, e

    ok, value = gevent.get_hub().threadpool.apply(call)
    if not ok:
        raise value
    return value


def serve(app: Any, port: int, bind: str = "127.0.0.1", log: logging.Logger | None = None,
          on_stop: Callable[[], None] | None = None, ssl_context: Optional[ssl.SSLContext] = None,
          on_listening: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or ``server.stop``), over TLS with ``ssl_context``;
    ``on_listening`` runs once the port is bound, ``on_stop`` once it has stopped."""
    import gevent

    tls = {"ssl_context": ssl_context} if ssl_context is not None else {}
    raise_open_files_limit()
    server = make_server((bind, port), app, error_log=log, **tls)
    for sig in (signal.SIGINT, signal.SIGTERM):  # stopping waits for the connections: not in the handler
        signal.signal(sig, lambda *_: gevent.spawn(server.stop, timeout=2))
    server.start()
    if on_listening:
        on_listening()
    server.serve_forever()
    if on_stop:
        on_stop()


IDLE_READ_S = 30.0  # a connection that sends nothing for this long is closed
REQUEST_HEAD_S = 10.0  # the request line and headers arrive within this, or the connection is closed
TLS_HANDSHAKE_S = 10.0  # a TLS handshake ends within this, or the connection is closed
BACKLOG = 4096  # connections the kernel queues before they are accepted (a burst is not dropped)
# connections accepted each time the loop comes round (gevent's default, 100, let a thousand nodes'
# uploads at a run's end overflow the queue while the loop served the ones before: their SYNs
# were dropped and retried 1, 3, 7, 15 s later)
MAX_ACCEPT = 1024


def make_server(listener: Any, app: Any, places: Optional[Places] = None, idle_read_s: Optional[float] = None,
                freebind: bool = False, **kw: Any) -> Any:
    """gevent's WSGI server on ``listener`` ((address, port) or a bound socket), charging each
    connection to its caller in ``places`` (new ones by default; listeners of one server share
    them), closing a connection whose read waits ``idle_read_s`` or whose request head takes
    longer than ``REQUEST_HEAD_S``, and telling the app the address each connection was
    accepted on (environ ``edgetb.local_addr``) and its caller (``edgetb.caller``). ``freebind``:
    the address may not exist yet (a bridge made later); the listening socket is bound with
    IP_FREEBIND."""

    if freebind and isinstance(listener, tuple):
        family = socket.AF_INET6 if ":" in listener[0] else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_FREEBIND", 15), 1)
        try:
            sock.bind(listener)
            sock.listen(BACKLOG)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        listener = sock
    kw.setdefault("log", None)
    if isinstance(listener, tuple):  # a socket given is listening already (with BACKLOG when made above)
        kw.setdefault("backlog", BACKLOG)
    idle = IDLE_READ_S if idle_read_s is None else idle_read_s
    server = _server_class(idle)(listener, app, spawn="default", **kw)
    server.places = places if places is not None else Places()
    return server


class Servers:
    """One app served on several addresses, sharing one set of places (a caller's share is the
    same whichever address it calls): started, served and stopped together (what ``WSGIServer``
    offers for one)."""

    def __init__(self, addresses: list[tuple[str, int]], app: Any, places: Optional[Places] = None,
                 freebind: bool = True, **kw: Any) -> None:
        self.addresses = list(dict.fromkeys(addresses))
        self.places = places if places is not None else Places()
        self.servers = []
        raise_open_files_limit()
        try:
            for a in self.addresses:
                self.servers.append(make_server(a, app, places=self.places,
                                                freebind=freebind and not is_loopback_host(a[0]), **kw))
        except BaseException:
            self.close()
            raise
        self._stopped: Any = None

    def start(self) -> None:
        """Listen on every address, or on none (OSError naming the address that failed)."""
        import gevent.event

        self._stopped = gevent.event.Event()
        started = []
        for address, server in zip(self.addresses, self.servers):
            try:
                server.start()
            except OSError as e:
                for s in started:
                    s.stop(timeout=0)
                self.close()
                raise OSError(e.errno, f"{address[0]}:{address[1]}: {e.strerror or e}") from None
            started.append(server)

    def serve_forever(self) -> None:
        if self._stopped is None:
            self.start()
        self._stopped.wait()

    def stop(self, timeout: float = 1) -> None:
        for server in self.servers:
            server.stop(timeout=timeout)
        if self._stopped is not None:
            self._stopped.set()

    def close(self) -> None:
        """Close every listening socket made (a start that failed keeps no port bound)."""
        for server in self.servers:
            sock = getattr(server, "socket", None)
            if sock is not None:
                sock.close()


class HeadTooSlow(socket.timeout):
    """The request head (or a TLS handshake) did not arrive in time."""


def _server_class(idle_read_s: Optional[float] = IDLE_READ_S) -> Any:
    """gevent's WSGI server with Nagle's algorithm off on every connection (a response written
    in two pieces, headers then body, otherwise waits for the client's delayed ACK: 40 ms on
    loopback), each connection charged to its caller at accept (closed at once over its share),
    reads that time out after ``idle_read_s``, a deadline for each request head and TLS
    handshake, and the accepted address and the caller in environ."""
    import gevent
    from gevent.pywsgi import WSGIHandler, WSGIServer

    class Handler(WSGIHandler):
        _head_deadline: Any = None

        def handle_one_request(self) -> Any:
            # a kept-alive connection waits for its next request as long as any read may (idle_read_s);
            # from its first byte, the whole head must come within REQUEST_HEAD_S
            try:
                if not self.rfile.closed and not self.rfile.peek(1):
                    return None  # the caller hung up
            except (OSError, ValueError):
                return None
            self._head_deadline = gevent.Timeout.start_new(REQUEST_HEAD_S, HeadTooSlow("request head too slow"))
            try:
                return super().handle_one_request()
            finally:
                self._head_deadline.close()

        def read_request(self, raw_requestline: str) -> Any:
            try:
                return super().read_request(raw_requestline)
            finally:
                self._head_deadline.close()  # the head is in: the body and the answer take their time

        def _handle_client_error(self, ex: Exception) -> Any:
            if isinstance(ex, OSError):  # a deadline or a reset in the head: close, nothing to tell
                return None
            return super()._handle_client_error(ex)

        def get_environ(self) -> Any:
            env = super().get_environ()
            try:
                env[LOCAL_ADDR_KEY] = self.socket.getsockname()[:2]
            except (OSError, TypeError):  # not an IP socket (a test's socketpair)
                pass
            env[CALLER_KEY] = self.server.callers.get(self.socket)
            env[PLACES_KEY] = self.server.places
            env[SOCKET_KEY] = self.socket
            return env

    class NoDelayServer(WSGIServer):
        handler_class = Handler
        places: Places
        max_accept = MAX_ACCEPT

        def __init__(self, *args: Any, **kw: Any) -> None:
            super().__init__(*args, **kw)
            self.callers: dict[Any, Key] = {}  # each connection's caller, by its (TLS-wrapped) socket

        def do_handle(self, sock: Any, address: Any) -> None:
            """Charge the connection to its caller, or close it at once when the caller holds its share."""
            key = self.places.key_of(sock)
            if not self.places.take(key):
                sock.close()
                return
            self.callers[sock] = key
            super().do_handle(sock, address)

        def do_close(self, sock: Any, *args: Any) -> None:
            key = self.callers.pop(sock, None)
            if key is not None:
                self.places.give_back(key)
            super().do_close(sock, *args)

        def wrap_socket_and_handle(self, client_socket: Any, address: Any) -> Any:
            """The TLS handshake under a deadline (a caller that never sends its hello is closed)."""
            try:
                with gevent.Timeout(TLS_HANDSHAKE_S, HeadTooSlow("TLS handshake too slow")):
                    tls_socket = self.wrap_socket(client_socket, **self.ssl_args)
            except OSError:  # the deadline, a reset, a bad hello: nothing to answer
                return None
            self.callers[tls_socket] = self.callers.get(client_socket)  # type: ignore[assignment]
            try:
                return self.handle(tls_socket, address)
            finally:
                self.callers.pop(tls_socket, None)
                tls_socket.close()

        def handle(self, sock: Any, address: Any) -> Any:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # not TCP (a test's socketpair): nothing to turn off
                pass
            if idle_read_s:
                sock.settimeout(idle_read_s)
            return super().handle(sock, address)

    return NoDelayServer


def bearer_matches(header: str, token: str) -> bool:
    """Whether an Authorization header carries exactly ``token`` (constant-time compare)."""
    import hmac

    return bool(token) and header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), token.encode())


def check_token(token: Optional[str], source: str) -> str:
    """``token`` if it is long enough to be a secret, else ConfigError naming ``source``."""
    from worker.api.errors import ConfigError

    if not isinstance(token, str) or len(token.strip()) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the token from {source} is shorter than {MIN_TOKEN_CHARS} characters: use a random "
                          "secret, e.g. python3 -c 'import secrets; print(secrets.token_urlsafe(32))'")
    return token.strip()


def request_limits(app: Any, limits: Mapping[str, int], default_bytes: int) -> None:
    """Refuse bodies on GET, HEAD and DELETE (400), and bodies larger than the route's limit
    (413; ``limits`` by endpoint name, else ``default_bytes``), before any of it is read."""
    from flask import request
    from werkzeug.exceptions import BadRequest, RequestEntityTooLarge

    app.config["MAX_CONTENT_LENGTH"] = max([default_bytes, *limits.values()])

    @app.before_request
    def limit_body() -> None:
        has_body = bool(request.content_length) or "Transfer-Encoding" in request.headers
        if request.method in BODYLESS_METHODS and has_body:
            raise BadRequest(f"{request.method} requests carry no body")
        limit = limits.get(request.endpoint or "", default_bytes)
        if request.content_length is not None and request.content_length > limit:
            raise RequestEntityTooLarge(f"{request.method} {request.path} takes at most {limit} bytes")
        try:
            request.max_content_length = limit  # a chunked body (Flask >= 3.1)
        except AttributeError:
            pass


def json_errors(app: Any, log: logging.Logger) -> None:
    """Answer every error of ``app`` as JSON ``{"error": ..., "detail": ...}`` with its status.
    An unexpected exception is logged with a reference; the client gets only that reference."""
    from flask import jsonify
    from werkzeug.exceptions import HTTPException

    from worker.api.errors import TestbedError

    @app.errorhandler(TestbedError)
    def testbed_error(err: TestbedError) -> Any:
        return jsonify(err.to_json()), err.http_status

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException) -> Any:
        return jsonify({"error": err.name.lower().replace(" ", "_"), "detail": err.description}), err.code

    @app.errorhandler(Exception)
    def internal_error(err: Exception) -> Any:
        reference = secrets.token_hex(4)
        log.exception("internal error, reference %s", reference)
        return jsonify({"error": "internal", "reference": reference,
                        "detail": f"internal error (reference {reference}: see the server's log)"}), 500
