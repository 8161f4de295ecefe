"""Serving a Flask app with gevent's WSGI server, with blocking work in real threads.

Nothing is monkey-patched: network-namespace work (setns) must run on real OS
threads, so handlers hand blocking calls to gevent's thread pool.
"""
from __future__ import annotations

import logging
import signal
from typing import Any, Callable


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


def serve(app: Any, port: int, bind: str = "0.0.0.0", log: logging.Logger | None = None,
          on_stop: Callable[[], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or ``server.stop``); ``on_stop`` runs once it has stopped."""
    from gevent.pywsgi import WSGIServer

    server = WSGIServer((bind, port), app, log=None, error_log=log)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop(timeout=2))
    server.serve_forever()
    if on_stop:
        on_stop()


def bearer_matches(header: str, token: str) -> bool:
    """Whether an Authorization header carries exactly ``token`` (constant-time compare)."""
    import hmac

    return bool(token) and header.startswith("Bearer ") and hmac.compare_digest(header[7:].encode(), token.encode())


def json_errors(app: Any, log: logging.Logger) -> None:
    """Answer every error of ``app`` as JSON ``{"error": ..., "detail": ...}`` with its status."""
    from flask import jsonify
    from werkzeug.exceptions import HTTPException

    from worker.errors import TestbedError

    @app.errorhandler(TestbedError)
    def testbed_error(err: TestbedError) -> Any:
        return jsonify(err.to_json()), err.http_status

    @app.errorhandler(HTTPException)
    def http_error(err: HTTPException) -> Any:
        return jsonify({"error": err.name.lower().replace(" ", "_"), "detail": err.description}), err.code

    @app.errorhandler(Exception)
    def internal_error(err: Exception) -> Any:
        log.exception("internal error")
        return jsonify({"error": "internal", "detail": f"{type(err).__name__}: {err}"}), 500
