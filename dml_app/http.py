"""The node's HTTP layer: a tiny WSGI router served by gevent, and a client.

Kept free of Flask and requests so that a node process stays small (hundreds
run on one host). Bodies are size-limited; errors are JSON
``{"error": ..., "detail": ...}``.
"""
from __future__ import annotations

import http.client
import json
import time
from _operator import _compare_digest as compare_digest  # what hmac uses, without loading OpenSSL
from dataclasses import dataclass, field
from typing import Any, Callable, Optional
from urllib.parse import parse_qs, urlsplit

MAX_BODY_BYTES = 256 * 1024 * 1024
JSON = "application/json"


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

    def json(self) -> Any:
        try:
            return json.loads(self.body or b"null")
        except ValueError as e:
            raise HttpError(400, "bad_json", f"body is not JSON: {e}") from None


Response = tuple[int, str, bytes]
Handler = Callable[[Request], Response]


def json_response(data: Any, status: int = 200) -> Response:
    return status, JSON, json.dumps(data).encode()


_REASONS = {200: "OK", 201: "Created", 202: "Accepted", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 409: "Conflict", 413: "Payload Too Large", 500: "Internal Server Error",
            503: "Service Unavailable"}


class Router:
    """Maps (method, path) to handlers; a WSGI application. With a ``token``, every
    POST must carry ``Authorization: Bearer <token>`` (POSTs change state)."""

    def __init__(self, token: str = "") -> None:
        self.routes: dict[tuple[str, str], Handler] = {}
        self.token = token

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.routes[(method, path)] = handler

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        try:
            status, ctype, body = self._dispatch(environ)
        except HttpError as e:
            status, ctype, body = json_response({"error": e.error, "detail": e.detail}, e.status)
        except Exception as e:  # a bug: answer, do not die
            status, ctype, body = json_response({"error": "internal", "detail": f"{type(e).__name__}: {e}"}, 500)
        start_response(f"{status} {_REASONS.get(status, '')}", [("Content-Type", ctype), ("Content-Length", str(len(body)))])
        return [body]

    def _dispatch(self, environ: dict[str, Any]) -> Response:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "/")
        handler = self.routes.get((method, path))
        if handler is None:
            if any(p == path for _, p in self.routes):
                raise HttpError(405, "method_not_allowed", f"{method} {path}")
            raise HttpError(404, "not_found", f"no route {path}")
        if self.token and method == "POST":
            given = environ.get("HTTP_AUTHORIZATION", "")
            if not compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                raise HttpError(401, "unauthorized", "this call needs the run's node token")
        length = int(environ.get("CONTENT_LENGTH") or 0)
        if length > MAX_BODY_BYTES:
            raise HttpError(413, "too_large", f"body of {length} bytes is over {MAX_BODY_BYTES}")
        body = environ["wsgi.input"].read(length) if length else b""
        query = {k: v[0] for k, v in parse_qs(environ.get("QUERY_STRING", "")).items()}
        headers = {k[5:].replace("_", "-").lower(): v for k, v in environ.items() if k.startswith("HTTP_")}
        return handler(Request(method, path, query, body, environ.get("CONTENT_TYPE", ""), headers))


def request(method: str, url: str, body: Optional[bytes] = None, content_type: str = JSON,
            timeout_s: float = 30.0, retries: int = 0, backoff_s: float = 0.5,
            headers: Optional[dict[str, str]] = None) -> tuple[int, bytes]:
    """One HTTP request (retried on connection errors); returns (status, body)."""
    parts = urlsplit(url)
    target = parts.path + (f"?{parts.query}" if parts.query else "")
    last: Exception = OSError("no attempt")
    for attempt in range(retries + 1):
        conn = http.client.HTTPConnection(parts.hostname, parts.port or 80, timeout=timeout_s)
        try:
            sent = dict(headers or {})
            if body is not None:
                sent["Content-Type"] = content_type
            conn.request(method, target or "/", body=body, headers=sent)
            resp = conn.getresponse()
            return resp.status, resp.read()
        except (OSError, http.client.HTTPException) as e:
            last = e
            if attempt < retries:
                time.sleep(backoff_s * (attempt + 1))
        finally:
            conn.close()
    raise ConnectionError(f"{method} {url}: {type(last).__name__}: {last}")


def post_json(url: str, data: Any, timeout_s: float = 30.0, retries: int = 2,
              headers: Optional[dict[str, str]] = None) -> Any:
    status, body = request("POST", url, json.dumps(data).encode(), JSON, timeout_s, retries, headers=headers)
    if status >= 400:
        raise ConnectionError(f"POST {url}: {status} {body[:300]!r}")
    return json.loads(body or b"null")
