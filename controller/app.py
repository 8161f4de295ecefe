"""The controller's REST API on port 3333: thin routes over ``Experiment``.

The EdgeTB workflow (``curl localhost:3333/start``) works unchanged from the
controller's own host: calls from loopback are trusted. From anywhere else a
state-changing call needs ``Authorization: Bearer <admin token>``. A node
signs ``/print`` and ``/log`` with a key derived from its own secret, which the
controller handed it when it started it: the node is the one whose key verifies
(``controller.node_auth``), never the one a message names. Agents of other
hosts fetch code with the run's token.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

from flask import Flask, jsonify, request

from controller import files
from controller.experiment import MAX_LOG_BYTES, Experiment
from worker.errors import AuthError, ConfigError
from worker.serving import bearer_matches, json_errors, run_blocking

log = logging.getLogger("edgetb.controller")
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bearer_is(token: Optional[str]) -> bool:
    return bearer_matches(request.headers.get("Authorization", ""), token or "")


def create_app(exp: Experiment, admin_token: Optional[str] = None, on_reset: Optional[Callable[[], None]] = None) -> Flask:
    """The controller app for ``exp``; ``on_reset`` runs after /emulated/reset (e.g. to stop serving)."""
    app = Flask("edgetb-controller")
    app.config["MAX_CONTENT_LENGTH"] = MAX_LOG_BYTES + 1024

    def user() -> None:
        if request.remote_addr not in LOOPBACK and not _bearer_is(admin_token):
            raise AuthError("calls from other hosts need the controller's bearer token")

    def agent() -> None:
        if not _bearer_is(exp.node_token):
            raise AuthError("code sync needs the run's token")

    def node() -> str:
        """The node that signed this call (its own key), or AuthError."""
        target = request.path + (f"?{request.query_string.decode()}" if request.query_string else "")
        return exp.keys.verify(request.headers, request.method, target, request.get_data, exp.nodes)

    json_errors(app, log)
    # agents of other hosts fetch this checkout's code and the experiment's shards, with the run's token
    files.register(app, {"dml_app": CODE_ROOT, "dataset": exp.workdir}, agent)

    @app.get("/status")
    def status() -> Any:
        return jsonify(exp.status())

    @app.get("/conf/dataset")
    def conf_dataset() -> Any:
        user()
        return jsonify(run_blocking(exp.push_dataset_confs))

    @app.get("/conf/structure")
    def conf_structure() -> Any:
        user()
        return jsonify(run_blocking(exp.push_structure_confs))

    @app.get("/start")
    def start() -> Any:
        user()
        return jsonify(run_blocking(exp.start))

    @app.get("/finish")
    def finish() -> Any:
        user()
        return jsonify(run_blocking(exp.finish))

    @app.get("/update/tc")
    def update_tc() -> Any:
        user()
        file = request.args.get("file")
        if not file:
            raise ConfigError("give the links file: /update/tc?file=links_update.json")
        return jsonify(run_blocking(exp.update_tc, file))

    @app.get("/emulated/reset")
    def emulated_reset() -> Any:
        user()
        result = run_blocking(exp.reset)
        if on_reset:
            on_reset()
        return jsonify(result)

    @app.get("/physical/reset")
    def physical_reset() -> Any:
        user()
        physical = [n.name for n in exp.topology.nodes.values() if n.kind == "physical"]
        return jsonify({"version": 1, "physical_nodes": physical, "reset": physical == []})

    @app.post("/print")
    def print_line() -> Any:
        exp.on_print(node(), request.get_json(silent=True))
        return jsonify({"ok": True})

    @app.post("/log")
    def upload_log() -> Any:
        return jsonify(run_blocking(exp.on_log, node(), request.get_data()))

    return app
