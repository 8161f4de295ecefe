"""The live dashboard: a page at ``/`` and the JSON it reads (``controller.web.live`` describes a view).

- ``GET /``: the page (``controller/web/static/dashboard.html``; its libraries are vendored under
  ``static/vendor/`` by ``scripts/vendor_js.py``: no CDN, works offline);
- ``GET /api/view``: the view of the run this controller drives;
- ``GET /api/stream``: Server-Sent Events, one ``data:`` message per new sample (about 1 Hz),
  per new timeline entry or phase change, with what the page has not seen
  (``?samples=N&events=M&phase=P`` say what it has);
- ``GET /api/runs``, ``GET /api/runs/<id>``: the runs in the experiment's ``dml_file/log/``
  and the view of one, from its files;
- ``GET /api/link?src=&dst=[&run=<id>]``: one link's throughput series and its rate;
- ``POST /api/link`` ``{"src", "dst", "bw"}``: change a link's rate in place.

``edgetb dashboard`` serves the same page for the stored runs alone (``create_viewer``).

Reading needs what ``/status`` needs (loopback or the admin token); the POST needs what every
state change needs (``controller.web.app``): a trusted local user or the admin token, and a page
of this origin. The page's buttons post to ``/start``, ``/finish`` and ``/emulated/reset``.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any, Callable, Optional

from flask import Flask, Response, jsonify, request, send_from_directory
from werkzeug.exceptions import TooManyRequests

from controller.web import run_view
from worker.api.errors import ConfigError, NotFound
from worker.serving import CALLER_KEY, PLACES_KEY, SOCKET_KEY, run_blocking

STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
PUSH_CHECK_S = 0.25  # how often a stream looks for a new sample
KEEPALIVE_S = 15.0  # a comment line on a quiet stream, so that proxies and the page know it lives
STREAM_MAX_S = 3600.0  # a stream ends after this; the page reconnects (EventSource does) with its cursor


def _int_arg(name: str) -> int:
    text = request.args.get(name, "0")
    if not text.isdigit() or len(text) > 12:
        raise ConfigError(f"?{name}= must be a whole number, not {text[:20]!r}")
    return int(text)


def _left(client: Any, wait_s: float) -> bool:
    """Wait ``wait_s``, or less when the client of a stream hangs up: whether it did (its end
    closed or reset; data it sends meanwhile is not read, a stream's client sends none)."""
    import gevent
    from gevent.socket import wait_read

    if client is None:
        gevent.sleep(wait_s)
        return False
    try:
        wait_read(client.fileno(), timeout=wait_s)
    except socket.timeout:
        return False  # nothing came: still there
    except (OSError, ValueError):
        return True  # the socket is closed already
    try:
        if client.recv(1, socket.MSG_PEEK) == b"":
            return True
    except BlockingIOError:
        return False
    except OSError:
        return True
    except ValueError:  # a TLS socket cannot peek: it is watched by its writes alone
        pass
    gevent.sleep(wait_s)  # it sent something: that does not end the stream
    return False


def register(app: Flask, workdir: str, reader: Callable[[], None], user: Callable[[], None],
             exp: Optional[Any] = None) -> None:
    """Add the dashboard's routes to ``app``: runs of ``workdir``, the live run of ``exp`` (if any)."""

    def live() -> Any:
        if exp is None:
            raise NotFound("this server shows stored runs only: open one from /api/runs")
        return exp.live

    @app.get("/")
    def page() -> Any:
        reader()
        return send_from_directory(STATIC, "dashboard.html", max_age=0)

    @app.get("/api/view")
    def view() -> Any:
        reader()
        return jsonify(live().view())

    @app.get("/api/stream")
    def stream() -> Any:
        reader()
        feed = live()
        seen = [_int_arg("samples"), _int_arg("events"), request.args.get("phase", "")[:20]]
        places, caller, client = (request.environ.get(k) for k in (PLACES_KEY, CALLER_KEY, SOCKET_KEY))
        if places is not None and not places.take_stream(caller):
            raise TooManyRequests(f"at most {places.streams_per_caller} streams at once for one caller")

        def messages() -> Any:
            started = quiet = time.monotonic()
            try:
                yield "retry: 2000\n\n"
                while time.monotonic() - started < STREAM_MAX_S:
                    update = feed.update(*seen)
                    if update is not None:
                        seen[:] = [update["samples"], update["events"][-1]["seq"] if update["events"] else seen[1],
                                   update["phase"]]
                        quiet = time.monotonic()
                        yield f"data: {json.dumps(update, separators=(',', ':'))}\n\n"
                    elif time.monotonic() - quiet > KEEPALIVE_S:
                        quiet = time.monotonic()
                        yield ": alive\n\n"
                    if _left(client, PUSH_CHECK_S):
                        return
            finally:
                if places is not None:
                    places.give_back_stream(caller)

        return Response(messages(), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/api/runs")
    def runs() -> Any:
        reader()
        current = exp.run_id if exp is not None else None
        return jsonify({"version": 1, "live_run": current, "runs": run_blocking(run_view.list_runs, workdir)})

    @app.get("/api/runs/<run_id>")
    def stored(run_id: str) -> Any:
        reader()
        return jsonify(run_blocking(run_view.stored_view, run_view.run_dir_of(workdir, run_id)))

    @app.get("/api/link")
    def link_series() -> Any:
        reader()
        src, dst, run = request.args.get("src", ""), request.args.get("dst", ""), request.args.get("run")
        if run and (exp is None or run != exp.run_id):
            return jsonify(run_blocking(run_view.stored_link_series, run_view.run_dir_of(workdir, run), src, dst))
        return jsonify(live().link_series(src, dst))

    @app.post("/api/link")
    def change_link() -> Any:
        user()
        if exp is None:
            raise NotFound("no run under way: a link is changed on a live run")
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not all(isinstance(body.get(k), str) for k in ("src", "dst", "bw")):
            raise ConfigError('give the link and its rate: POST {"src": "n1", "dst": "n2", "bw": "5mbit"}')
        return jsonify(run_blocking(exp.update_link, body["src"], body["dst"], body["bw"]))


def create_viewer(workdir: str) -> Flask:
    """A read-only server of ``workdir``'s stored runs (``edgetb dashboard``): the page and the
    runs' views for loopback callers of this host's names; nothing it serves changes anything."""
    from controller.web import callers
    from worker.api.errors import AuthError
    from worker.serving import json_errors

    app = Flask("edgetb-dashboard", static_folder=STATIC, static_url_path="/static")
    hosts = callers.HostPolicy()

    @app.before_request
    def same_site() -> None:
        hosts.check(request.headers)

    def reader() -> None:
        if not callers.is_loopback(request.remote_addr):
            raise AuthError("the stored runs are served to this host only (ssh -L to look from elsewhere)")

    def user() -> None:
        raise NotFound("this server shows stored runs only")

    json_errors(app, logging.getLogger("edgetb.dashboard"))
    register(app, workdir, reader, user)
    return app
