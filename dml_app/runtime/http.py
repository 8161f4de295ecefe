"""The node's HTTP layer: a tiny WSGI router served by gevent, and a client.

Kept free of Flask and requests so that a node process stays small (hundreds
run on one host). Every route says who may call it (``public``, the
``controller``, a ``peer`` node end to end, or a linked ``hop`` only: see
``dml_app.runtime.auth``) and how large a body it takes; a GET with a body, a body over
the route's limit or without a length is refused before it is read. Errors are
JSON ``{"error": ..., "detail": ...}``; an internal error is logged on stderr
with a short reference, and the caller is told only that reference.
"""
from __future__ import annotations

import json
import os
import select
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union
from urllib.parse import parse_qs, urlsplit

from dml_app.runtime.auth import (ANSWER_SIG, E2E, AuthFailed, NodeKeys, body_hash, claimed_digest,
                                  compare_digest)
from dml_app.wire import bounded_json

CONTINUE_WAIT_S = 0.5  # the longest a body waits for the server's 100 Continue
CONTINUE_STATUS = b"HTTP/1.1 100 "
MAX_BODY_BYTES = 256 * 1024 * 1024  # no route takes more, whatever its own limit says
CONTROL_BODY_BYTES = 4 * 1024  # /prepare, /start, /stop, small role messages
JSON = "application/json"
AUTH_KINDS = ("public", "controller", "peer", "hop")


class HttpError(Exception):
    """Raised by a handler to answer with ``status`` and a JSON error body."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail = status, error, detail


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    content_type: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    sender: str = ""  # who signed it end to end (a peer, or "controller"); "" on public routes
    hop: str = ""  # the linked node that passed it on (peer and hop routes)
    answer_headers: dict[str, str] = field(default_factory=dict)  # a handler's headers for its answer

    def json(self) -> Any:
        try:
            return bounded_json.loads(self.body or b"null")
        except ValueError as e:
            raise HttpError(400, "bad_json", f"body is not JSON: {e}") from None


Response = tuple[int, str, bytes]
Handler = Callable[[Request], Response]
Limit = Union[int, Callable[[], int]]


def json_response(data: Any, status: int = 200) -> Response:
    return status, JSON, json.dumps(data).encode()


_REASONS = {200: "OK", 201: "Created", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 411: "Length Required", 413: "Payload Too Large",
            500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable", 508: "Loop Detected"}


@dataclass
class Route:
    handler: Handler
    auth: str
    max_body: Limit
    early: Optional[Callable[[Request], Optional[Response]]] = None  # an answer from the headers alone


def _skip_body(environ: dict[str, Any]) -> None:
    """Leave a refused body unread: gevent would otherwise read it to the end after the
    answer (to keep the connection), so mark it consumed; the answer closes the connection."""
    stream = environ.get("wsgi.input")
    if hasattr(stream, "content_length") and hasattr(stream, "position"):
        stream.content_length = stream.position
        stream.chunked_input = False


class Router:
    """Maps (method, path) to routes; a WSGI application. ``keys`` (a callable, since
    a node learns its pair keys after it starts) checks signed calls; without keys,
    only public routes answer."""

    def __init__(self, keys: Callable[[], Optional[NodeKeys]] = lambda: None, name: str = "node") -> None:
        self.routes: dict[tuple[str, str], Route] = {}
        self.keys = keys
        self.name = name

    def add(self, method: str, path: str, handler: Handler, auth: str, max_body: Limit = CONTROL_BODY_BYTES,
            early: Optional[Callable[[Request], Optional[Response]]] = None) -> None:
        """``early``: called once the call is authenticated, before its body is read (the
        request's body is then empty); an answer it gives is the answer, the body left unread
        (a caller that sent ``Expect: 100-continue`` never sends it)."""
        if auth not in AUTH_KINDS:
            raise ValueError(f"unknown auth kind {auth!r}: one of {', '.join(AUTH_KINDS)}")
        self.routes[(method, path)] = Route(handler, auth, max_body, early)

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        extra: list[tuple[str, str]] = []
        try:
            status, ctype, body, signed = self._dispatch(environ)
            extra += signed.items()
        except HttpError as e:
            status, ctype, body = json_response({"error": e.error, "detail": e.detail}, e.status)
            if environ.get("edgetb.body_unread"):
                extra.append(("Connection", "close"))
        except Exception:  # a bug: log it with a reference, answer with the reference only
            ref = os.urandom(4).hex()
            print(f"{self.name}: internal error ref {ref} on {environ.get('REQUEST_METHOD')} "
                  f"{environ.get('PATH_INFO')}:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            status, ctype, body = json_response({"error": "internal", "detail": f"internal error, reference {ref}",
                                                 "reference": ref}, 500)
        start_response(f"{status} {_REASONS.get(status, '')}",
                       [("Content-Type", ctype), ("Content-Length", str(len(body))), *extra])
        return [body]

    def _refuse_body(self, environ: dict[str, Any], status: int, error: str, detail: str) -> HttpError:
        _skip_body(environ)
        environ["edgetb.body_unread"] = True
        return HttpError(status, error, detail)

    def _dispatch(self, environ: dict[str, Any]) -> tuple[int, str, bytes, dict[str, str]]:
        """The route's answer and its headers: on a peer route, this node's signature of it."""
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/")
        route = self.routes.get((method, path))
        chunked = "chunked" in environ.get("HTTP_TRANSFER_ENCODING", "").lower()
        try:
            length = int(environ.get("CONTENT_LENGTH") or 0)
        except ValueError:
            raise self._refuse_body(environ, 400, "bad_length", "Content-Length is not a number") from None
        if route is None:
            if length or chunked:
                _skip_body(environ)
                environ["edgetb.body_unread"] = True
            if any(p == path for _, p in self.routes):
                raise HttpError(405, "method_not_allowed", f"{method} {path}")
            raise HttpError(404, "not_found", f"no route {path}")
        if method in ("GET", "HEAD", "DELETE", "OPTIONS") and (length or chunked):
            raise self._refuse_body(environ, 400, "body_not_allowed", f"{method} {path} takes no body")
        if chunked:
            raise self._refuse_body(environ, 411, "length_required", "send a Content-Length, not a chunked body")
        query_string = environ.get("QUERY_STRING", "")
        target = path + (f"?{query_string}" if query_string else "")
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        sender = hop = ""
        digest = b""
        keys = None
        if route.auth != "public":  # the signature over the claimed body hash, before the body is read
            keys = self.keys()
            if keys is None:
                raise self._refuse_body(environ, 401, "unauthorized", "this node has no keys yet")
            try:
                digest = claimed_digest(headers)
                if route.auth == "controller":
                    keys.check_controller(headers, method, target, digest)
                    sender = "controller"
                else:
                    hop = keys.check_hop(headers, method, target, digest)
                    if route.auth == "peer":
                        sender = keys.check_peer(headers, method, path, digest)
            except AuthFailed as e:
                raise self._refuse_body(environ, 401, "unauthorized", str(e)) from None
        limit = min(route.max_body() if callable(route.max_body) else route.max_body, MAX_BODY_BYTES)
        if length > limit:
            raise self._refuse_body(environ, 413, "too_large", f"{method} {path} takes at most {limit} bytes, "
                                                                f"not {length}")
        query = {k: v[0] for k, v in parse_qs(query_string).items()}
        early = None
        if route.early is not None:
            req = Request(method, path, query, b"", environ.get("CONTENT_TYPE", ""), headers, sender=sender, hop=hop)
            early = route.early(req)
            if early is not None and length:
                _skip_body(environ)
                req.answer_headers["Connection"] = "close"
        if early is None:
            body = environ["wsgi.input"].read(length) if length else b""
            if len(body) != length:
                raise HttpError(400, "short_body", f"body ended after {len(body)} of {length} bytes")
            if digest and not compare_digest(body_hash(body), digest):
                raise HttpError(401, "unauthorized", "the body is not the one signed")
            req = Request(method, path, query, body, environ.get("CONTENT_TYPE", ""), headers, sender=sender, hop=hop)
        status, ctype, answer = early if early is not None else route.handler(req)
        if route.auth == "peer" and keys is not None:
            req.answer_headers[ANSWER_SIG] = keys.answer_sig(sender, headers.get(E2E[2].lower(), ""), answer)
        return status, ctype, answer, req.answer_headers


class AnswerTooLarge(ConnectionError):
    """An answer longer than the caller takes."""


class AnswerTooSlow(ConnectionError):
    """An answer not all there within the caller's deadline (a trickle holds nothing)."""


def request(method: str, url: str, body: Optional[bytes] = None, content_type: str = JSON,
            timeout_s: float = 30.0, retries: int = 0, backoff_s: float = 0.5,
            headers: Optional[dict[str, str] | Callable[[], dict[str, str]]] = None,
            max_answer_bytes: int = MAX_BODY_BYTES, answer_headers: Optional[dict[str, str]] = None,
            expect_continue: bool = False, answer_deadline_s: Optional[float] = None) -> tuple[int, bytes]:
    """One HTTP/1.1 request on a connection of its own (retried on connection errors); returns
    (status, body). ``headers`` may be a function, called for each attempt (signatures with fresh
    nonces). An answer over ``max_answer_bytes`` is a ``ConnectionError`` (not retried), read no
    further; ``answer_headers``, when given, receives the answer's headers (lower-case names). An
    attempt is given up after ``timeout_s`` in all (connecting and sending, then what is left of
    it for the answer to begin), so a send to a dead or cut-off peer does not linger.
    ``expect_continue``: the headers go first, the body only after the server's ``100
    Continue`` (or ``CONTINUE_WAIT_S`` of silence): a server that answers from the headers
    (a peer that takes no more models) costs no transfer. ``answer_deadline_s``: the whole
    answer arrives within this of the request being sent, or ``AnswerTooSlow`` (not retried).

    Written on the socket directly, not with ``http.client``: a node makes a few calls a round,
    and ``http.client`` parses every answer's headers with the ``email`` package (about half a
    node's CPU time outside training at 1,000 nodes)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    last: Exception = OSError("no attempt")
    for attempt in range(retries + 1):
        sock: Optional[socket.socket] = None
        try:
            sent = dict((headers() if callable(headers) else headers) or {})
            if body is not None:
                sent["Content-Type"] = content_type
            began = time.monotonic()
            sock = _connect(host, port, timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            waits = expect_continue and bool(body)
            head = _request_head(method, target, f"[{host}]:{port}" if ":" in host else f"{host}:{port}", sent, body, waits)
            reader = _AnswerReader(sock)
            if waits:
                _sendall(sock, head)
                if reader.continues_within(CONTINUE_WAIT_S):
                    _sendall(sock, body or b"")
            else:
                _sendall(sock, head + body if body and len(body) <= COALESCE_BYTES else head)
                if body and len(body) > COALESCE_BYTES:
                    _sendall(sock, body)
            sock.settimeout(max(0.001, timeout_s - (time.monotonic() - began)))  # what is left, for the answer
            if answer_deadline_s is not None:
                reader.deadline = time.monotonic() + answer_deadline_s
            status, got, answer = reader.answer(method, max_answer_bytes, url)
            if answer_headers is not None:
                answer_headers.update(got)
            return status, answer
        except (AnswerTooLarge, AnswerTooSlow):
            raise
        except (OSError, ValueError) as e:
            last = e
            if attempt < retries:
                time.sleep(backoff_s * (attempt + 1))
        finally:
            if sock is not None:
                sock.close()
    raise ConnectionError(f"{method} {url}: {type(last).__name__}: {last}")


COALESCE_BYTES = 64 * 1024  # a body up to this size goes in one send with its headers
MAX_HEAD_BYTES = 64 * 1024  # an answer's status line and headers
_TOKEN = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def _connect(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connected socket; an address is connected to directly (gevent's ``create_connection``
    would resolve even an address, in a thread of its pool: a few percent of a node's CPU)."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout_s)
            sock.connect((host, port))
        except BaseException:
            sock.close()
            raise
        return sock
    return socket.create_connection((host, port), timeout=timeout_s)


def _sendall(sock: socket.socket, data: bytes) -> None:
    sock.sendall(data)


def _request_head(method: str, target: str, host: str, headers: dict[str, str], body: Optional[bytes],
                  expect_continue: bool) -> bytes:
    """The request line and headers; a name that is not a token, or a value or target with a
    line break or control character, is a ``ValueError`` (no header can be smuggled in)."""
    fields = {"Host": host, "Accept-Encoding": "identity", "Connection": "close", **headers}
    if body is not None:
        fields["Content-Length"] = str(len(body))
    if expect_continue:
        fields["Expect"] = "100-continue"
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in fields.items():
        value = str(value)
        if not name or not set(name.encode("latin-1", "replace")) <= _TOKEN:
            raise ValueError(f"not a header name: {name!r}")
        if any(c < " " and c != "\t" or c == "\x7f" for c in value):
            raise ValueError(f"header {name}: a control character in its value")
        lines.append(f"{name}: {value}")
    if any(c <= " " or c == "\x7f" for c in target) or any(c <= " " for c in method):
        raise ValueError(f"not a request target: {target!r}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _AnswerReader:
    """Reads one HTTP/1.1 answer from a socket: an interim ``100 Continue`` (when asked for),
    then the status line, the headers and a body of ``Content-Length`` bytes, in chunks, or up
    to the connection's close."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.deadline: Optional[float] = None  # (monotonic) the whole answer by then

    def _fill(self) -> bool:
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise AnswerTooSlow("the answer took longer than its deadline")
            self.sock.settimeout(min(left, self.sock.gettimeout() or left))
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            if self.deadline is not None and time.monotonic() >= self.deadline:
                raise AnswerTooSlow("the answer took longer than its deadline") from None
            raise
        self.buf += data
        return bool(data)

    def continues_within(self, wait_s: float) -> bool:
        """Whether the body should go: a ``100 Continue`` came (then consumed), or nothing in
        ``wait_s`` (the server may not know Expect); False when a final answer came first."""
        deadline = time.monotonic() + wait_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return True  # silence: the body goes anyway (a late 100 is skipped)
            if not self._fill():
                return False  # closed: the answer (or its absence) is read as any other
            if not CONTINUE_STATUS.startswith(self.buf[:len(CONTINUE_STATUS)]):
                return False  # a final answer
            end = self.buf.find(b"\r\n\r\n")
            if end >= 0:
                self.buf = self.buf[end + 4:]
                return True

    def _head(self) -> tuple[int, dict[str, str]]:
        while True:
            end = self.buf.find(b"\r\n\r\n")
            while end < 0:
                if len(self.buf) > MAX_HEAD_BYTES:
                    raise ValueError(f"an answer's headers over {MAX_HEAD_BYTES} bytes")
                if not self._fill():
                    raise ConnectionResetError("the connection closed before an answer")
                end = self.buf.find(b"\r\n\r\n")
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            self.buf = self.buf[end + 4:]
            version, _, rest = lines[0].partition(" ")
            code = rest[:3]
            if not version.startswith("HTTP/1.") or not code.isdigit():
                raise ValueError(f"not an HTTP answer: {lines[0][:80]!r}")
            status = int(code)
            if 100 <= status < 200:
                continue  # an interim answer (a 100 Continue not waited for): the final one follows
            got: dict[str, str] = {}
            for line in lines[1:]:
                name, colon, value = line.partition(":")
                if not colon:
                    raise ValueError(f"a malformed header line in an answer: {line[:80]!r}")
                got[name.strip().lower()] = value.strip()
            return status, got

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise ConnectionResetError(f"the connection closed {n - len(self.buf)} bytes before the answer's end")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _line(self) -> bytes:
        while (end := self.buf.find(b"\r\n")) < 0:
            if len(self.buf) > MAX_HEAD_BYTES or not self._fill():
                raise ValueError("a malformed chunk in an answer")
        line, self.buf = self.buf[:end], self.buf[end + 2:]
        return line

    def answer(self, method: str, limit: int, url: str) -> tuple[int, dict[str, str], bytes]:
        """(status, headers, body); a body over ``limit`` bytes is ``AnswerTooLarge``, read no further."""
        status, got = self._head()
        if method == "HEAD" or status in (204, 304):
            return status, got, b""
        too_large = AnswerTooLarge(f"{method} {url}: an answer over the {limit} bytes taken")
        if "chunked" in got.get("transfer-encoding", "").lower():
            parts, size = [], 0
            while (n := int(self._line().split(b";")[0].strip() or b"x", 16)) > 0:
                size += n
                if size > limit:
                    raise too_large
                parts.append(self._exactly(n))
                self._exactly(2)
            return status, got, b"".join(parts)
        if "content-length" in got:
            length = int(got["content-length"])
            if length < 0:
                raise ValueError("a negative Content-Length in an answer")
            if length > limit:
                raise AnswerTooLarge(f"{method} {url}: an answer of {length} bytes, over the {limit} taken")
            return status, got, self._exactly(length)
        while len(self.buf) <= limit and self._fill():  # no length: the body ends with the connection
            pass
        if len(self.buf) > limit:
            raise too_large
        out, self.buf = self.buf, b""
        return status, got, out
