"""The controller's REST API on port 3333: thin routes over ``Experiment``.

Who may do what (``controller.web.callers`` reads the identities):

- Changing state (``/conf/*``, ``/start``, ``/finish``, ``/update/tc``, ``/node/*``, ``/*/reset``) needs
  ``Authorization: Bearer <admin token>`` (gl_run.py's ``--admin-token-file``; taken only on loopback, an SSH
  tunnel's end included, or TLS: over plain HTTP from another host it is refused), or a loopback caller whose socket
  belongs to root or to the user who started the controller through sudo: ``curl
  localhost:3333/start`` works for them, and is refused (403) for every other local user.
  EdgeTB's GET routes stay for curl; each also answers POST, for programs and browsers.
- ``/status``, ``/metrics`` and the dashboard (``/``, ``/api/*``: ``controller.web.dashboard``) are
  read by any loopback caller, or with the admin token; the dashboard's ``POST /api/link`` is a
  state change like the others.
- A node signs ``/print`` and ``/log`` with a key derived from its own secret, which the
  controller handed it when it started it: the node is the one whose key verifies
  (``controller.run.node_auth``), never the one a message names. ``/log``'s body is read only
  once the MAC over its headers, which carry the body's hash, verifies. Agents fetch ``/files`` with the
  run's token.
- Every request must name the controller in ``Host`` (a loopback name, an address of this
  machine, or a name in $EDGETB_ALLOWED_HOSTS), and is refused when a page of another site
  sent it (``Origin``, ``Referer``, ``Sec-Fetch-Site``). Bodies on GET are refused; each
  route has a size limit; an unexpected error answers only a reference to the log.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

from flask import Flask, jsonify, request

from controller.web import callers, dashboard

from controller.run.experiment import MAX_LOG_BYTES, Experiment
from controller.run.progress import printable
from controller.workers import files
from dml_app.wire import bounded_json
from worker.api import file_auth
from worker.api.errors import AuthError, ConfigError
from worker.host import REPO_ROOT
from worker.serving import bearer_matches, check_token, json_errors, request_limits, run_blocking

log = logging.getLogger("edgetb.controller")
USER_BODY_BYTES = 64 * 1024
PRINT_BODY_BYTES = 16 * 1024
CLEAR_TOKEN = ("the admin token is refused over plain HTTP from another host (it crossed the network in clear: "
               "replace it); reach the controller through an SSH tunnel, "
               "ssh -N -L 3333:127.0.0.1:3333 CONTROLLER_HOST, and call localhost:3333")


def _bearer_is(token: Optional[str]) -> bool:
    return bearer_matches(request.headers.get("Authorization", ""), token or "")


def private_channel() -> bool:
    """Whether this request came over a channel that keeps a bearer token off the network:
    loopback (an SSH tunnel's end included), or TLS."""
    return callers.is_loopback(request.remote_addr) or request.environ.get("wsgi.url_scheme") == "https"


def admin_call(token: Optional[str]) -> bool:
    """Whether the request carries the admin token ``token``; callers.Forbidden when it does over
    plain HTTP from another host, where the token crossed the network in clear."""
    if not _bearer_is(token):
        return False
    if private_channel():
        return True
    log.warning("a caller at %s sent the admin token over plain HTTP: refused; the token crossed the network "
                "in clear, so replace it", request.remote_addr)
    raise callers.Forbidden(CLEAR_TOKEN)


def create_app(exp: Experiment, admin_token: Optional[str] = None, on_reset: Optional[Callable[[], None]] = None,
               allowed_hosts: Iterable[str] = ()) -> Flask:
    """The controller app for ``exp``; ``on_reset`` runs after /emulated/reset (e.g. to stop
    serving); ``allowed_hosts``: names it answers to besides loopback and its own addresses."""
    admin_token = check_token(admin_token, "the controller's admin token") if admin_token else None
    app = Flask("edgetb-controller", static_folder=dashboard.STATIC, static_url_path="/static")
    hosts = callers.HostPolicy(allowed_hosts)
    trusted = callers.trusted_uids()
    request_limits(app, {"print_line": PRINT_BODY_BYTES, "upload_log": MAX_LOG_BYTES + 1024}, USER_BODY_BYTES)

    @app.before_request
    def same_site() -> None:
        hosts.check(request.headers)

    def user() -> None:
        if admin_call(admin_token):
            return
        caller = callers.caller_of(request.environ)
        if not caller.loopback:
            raise AuthError("calls from other hosts need the controller's bearer token")
        if caller.uid not in trusted:
            who = "an unknown local user" if caller.uid is None else f"local user uid {caller.uid}"
            raise callers.Forbidden(f"{who} may not change the testbed: only root, the user who started the "
                                    "controller with sudo, or a caller with the admin token")

    def reader() -> None:
        if not callers.is_loopback(request.remote_addr) and not admin_call(admin_token):
            raise AuthError("reading the status from other hosts needs the controller's bearer token")

    def agent() -> None:
        # signed with the run's token, which agents got over their pinned channel; never the token
        # itself, which would have crossed the LAN in clear (worker.api.file_auth)
        if not file_auth.verify(exp.node_token, request.headers.get("Authorization", ""), request.method,
                                request.path):
            raise AuthError("code sync needs a request signed with the run's token (EdgetbFiles), as agents make")

    def node(digest_first: bool = False) -> str:
        """The node that signed this call (its own key), or AuthError; ``digest_first``: the
        MAC over the headers (with the body's hash) is checked before the body is read."""
        target = request.path + (f"?{request.query_string.decode()}" if request.query_string else "")
        return exp.keys.verify(request.headers, request.method, target, request.get_data, exp.nodes, digest_first)

    json_errors(app, log)
    # agents of other hosts fetch this checkout's code and the experiment's shards, with the run's token
    files.register(app, {"dml_app": REPO_ROOT, "dataset": exp.workdir}, agent)

    dashboard.register(app, exp.workdir, reader, user, exp)

    @app.get("/status")
    def status() -> Any:
        reader()
        return jsonify(exp.status())

    @app.get("/metrics")
    def metrics() -> Any:
        """Prometheus exposition of the run (read-only; as /status: loopback or the admin token)."""
        reader()
        from controller.results.energy import away_windows
        from controller.telemetry.export import prometheus_text

        rows = list(exp.scenario.rows) if exp.scenario is not None else []
        away = away_windows(r for r in rows if str(r["outcome"]).startswith("applied"))  # no power while away
        body = prometheus_text(exp.run_id, exp.nodes.metrics_rows(), exp.telemetry,
                               {n.name: dict(n.device, away_s=away.get(n.name, [])) for n in exp.topology.nodes.values()
                                if n.device})
        return body, 200, {"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}

    @app.route("/conf/dataset", methods=("GET", "POST"))
    def conf_dataset() -> Any:
        user()
        return jsonify(run_blocking(exp.push_dataset_confs))

    @app.route("/conf/structure", methods=("GET", "POST"))
    def conf_structure() -> Any:
        user()
        return jsonify(run_blocking(exp.push_structure_confs))

    @app.route("/start", methods=("GET", "POST"))
    def start() -> Any:
        user()
        return jsonify(run_blocking(exp.start))

    @app.route("/finish", methods=("GET", "POST"))
    def finish() -> Any:
        user()
        return jsonify(run_blocking(exp.finish))

    @app.route("/update/tc", methods=("GET", "POST"))
    def update_tc() -> Any:
        user()
        body = request.get_json(silent=True) if request.method == "POST" else None
        file = request.args.get("file") or (body.get("file") if isinstance(body, dict) else None)
        if not file:
            raise ConfigError("give the links file: /update/tc?file=links_update.json (or POST {\"file\": ...})")
        return jsonify(run_blocking(exp.update_tc, file))

    def node_body() -> dict[str, Any]:
        body = request.get_json(silent=True)
        if not isinstance(body, dict) or not isinstance(body.get("node"), str):
            raise ConfigError('give the node: POST {"node": "n3"}')
        return body

    @app.post("/node/expect_death")
    def expect_death() -> Any:
        """``{"node": "n3", "why": "crashed"}``: n3 is about to be killed on purpose."""
        user()
        body = node_body()
        exp.expect_death(body["node"], str(body.get("why", "crashed")))
        return jsonify({"ok": True})

    @app.post("/node/replace")
    def replace_node() -> Any:
        """``{"node": "n3"}``: start dead n3's role again; it rejoins the run."""
        user()
        return jsonify(run_blocking(exp.replace_node, node_body()["node"]))

    @app.route("/emulated/reset", methods=("GET", "POST"))
    def emulated_reset() -> Any:
        user()
        result = run_blocking(exp.reset)
        if on_reset:
            on_reset()
        return jsonify(result)

    @app.route("/physical/reset", methods=("GET", "POST"))
    def physical_reset() -> Any:
        user()
        physical = [n.name for n in exp.topology.nodes.values() if n.kind == "physical"]
        return jsonify({"version": 1, "physical_nodes": physical, "reset": physical == []})

    @app.post("/print")
    def print_line() -> Any:
        sender = node()  # its signature first: nothing unsigned is parsed
        try:  # a node's line: its nesting bounded, malformed is nothing
            data = bounded_json.loads(request.get_data())
        except ValueError:
            data = None
        exp.on_print(sender, printable(data))
        return jsonify({"ok": True})

    @app.post("/log")
    def upload_log() -> Any:
        return jsonify(run_blocking(exp.on_log, node(digest_first=True), request.get_data()))

    return app
