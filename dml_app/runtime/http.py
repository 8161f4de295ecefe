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

import http.client
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


def request(method: str, url: str, body: Optional[bytes] = None, content_type: str = JSON,
            timeout_s: float = 30.0, retries: int = 0, backoff_s: float = 0.5,
            headers: Optional[dict[str, str] | Callable[[], dict[str, str]]] = None,
            max_answer_bytes: int = MAX_BODY_BYTES, answer_headers: Optional[dict[str, str]] = None,
            expect_continue: bool = False) -> tuple[int, bytes]:
    """One HTTP request (retried on connection errors); returns (status, body). ``headers``
    may be a function, called for each attempt (signatures with fresh nonces). An answer over
    ``max_answer_bytes`` is a ``ConnectionError`` (not retried), read no further;
    ``answer_headers``, when given, receives the answer's headers (lower-case names). An attempt
    is given up after ``timeout_s`` in all (connecting and sending, then what is left of it
    for the answer to begin), so a send to a dead or cut-off peer does not linger.
    ``expect_continue``: the headers go first, the body only after the server's ``100
    Continue`` (or ``CONTINUE_WAIT_S`` of silence): a server that answers from the headers
    (a peer that takes no more models) costs no transfer."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    last: Exception = OSError("no attempt")
    for attempt in range(retries + 1):
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
        try:
            sent = dict((headers() if callable(headers) else headers) or {})
            if body is not None:
                sent["Content-Type"] = content_type
            began = time.monotonic()
            if expect_continue and body:
                _send_expecting_continue(conn, method, target or "/", body, sent)
            else:
                conn.request(method, target or "/", body=body, headers=sent)
            if conn.sock is not None:  # the answer gets what is left of the attempt's time
                conn.sock.settimeout(max(0.001, timeout_s - (time.monotonic() - began)))
            resp = conn.getresponse()
            if (resp.length or 0) > max_answer_bytes:
                raise AnswerTooLarge(f"{method} {url}: an answer of {resp.length} bytes, over the "
                                     f"{max_answer_bytes} taken")
            answer = resp.read(max_answer_bytes + 1)
            if len(answer) > max_answer_bytes:
                raise AnswerTooLarge(f"{method} {url}: an answer over the {max_answer_bytes} bytes taken")
            if answer_headers is not None:
                answer_headers.update((k.lower(), v) for k, v in resp.getheaders())
            return resp.status, answer
        except AnswerTooLarge:
            raise
        except (OSError, http.client.HTTPException) as e:
            last = e
            if attempt < retries:
                time.sleep(backoff_s * (attempt + 1))
        finally:
            conn.close()
    raise ConnectionError(f"{method} {url}: {type(last).__name__}: {last}")


def _send_expecting_continue(conn: http.client.HTTPConnection, method: str, target: str, body: bytes,
                             headers: dict[str, str]) -> None:
    """The request's headers with ``Expect: 100-continue``, then its body unless the server
    answered first (its answer is then read as any other)."""
    conn.putrequest(method, target)
    for name, value in {**headers, "Content-Length": str(len(body)), "Expect": "100-continue"}.items():
        conn.putheader(name, value)
    conn.endheaders()
    sock = conn.sock
    assert sock is not None
    if not select.select([sock], [], [], CONTINUE_WAIT_S)[0]:
        conn.send(body)  # silence: the body goes anyway (the 100, if it comes, is skipped)
        return
    if _took_continue(sock):
        conn.send(body)
    # else: a final answer came before the body, which is not sent


def _took_continue(sock: socket.socket) -> bool:
    """Whether what the server sent first is an interim ``100 Continue`` (then consumed); a
    final answer is left for the response to read."""
    deadline = time.monotonic() + CONTINUE_WAIT_S
    while True:
        head = sock.recv(256, socket.MSG_PEEK)
        if not CONTINUE_STATUS.startswith(head[:len(CONTINUE_STATUS)]) or not head:
            return False  # another status (or the connection closed)
        end = head.find(b"\r\n\r\n")
        if end >= 0:
            sock.recv(end + 4)
            return True
        if time.monotonic() > deadline:
            return False  # a trickle: let the response read it (and fail)
        time.sleep(0.005)  # part of the interim answer has come
