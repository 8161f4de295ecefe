"""The worker agent: a small authenticated REST service over ``WorkerHost``.

Run as root on every worker host::

    python3 -m worker.agent --port 3334 --listen 10.254.0.2 [--id 0] [--subnet 10.77.0.0/16]
                            [--token-file F] [--runtime netns|docker|physical] [--workdir DIR]
    python3 -m worker.agent --print-fingerprint     # for hosts.json's tls_fingerprint

It serves HTTPS with a self-signed certificate made on its first start (``worker.tls``); the
controller pins its SHA-256 fingerprint. It listens on loopback unless told otherwise
(``--listen``); ``--plain-http`` is allowed on a loopback address only. Every call but ``GET
/health`` needs ``Authorization: Bearer <token>``; the token (16 characters at least) comes
from ``--token-file`` (mode 0600: refused when others may read it), else ``$EDGETB_TOKEN``, else
the state directory's token file (made, mode 0600, when missing). Blocking work runs
in gevent's pool of real threads, so the server keeps answering while a large network comes up.
"""
from __future__ import annotations

import argparse
import errno
import logging
import os
import re
import secrets
import stat
import sys
from typing import Any, Callable, Optional, cast

from flask import Flask, Response, jsonify, request

from worker import tls
from worker.api.errors import AuthError, ConfigError, TestbedError
from worker.api.peers import is_loopback_host
from worker.api.protocol import API_VERSION, DEFAULT_SUBNET, OPERATIONS, SMALL_REQUEST_BYTES, Operation
from worker.api.schema import Field, Place
from worker.host import WorkerHost
from worker.nodes.processes import STOP_GRACE_S
from worker.serving import (bearer_matches, check_token, json_errors, request_limits, run_blocking,
                            serve)
from worker.state import state_root

DEFAULT_PORT = 3333
DEFAULT_LISTEN = "127.0.0.1"
# body limits by route (endpoint name: the operation's); every other route takes SMALL_REQUEST_BYTES
REQUEST_LIMITS = {op.name: op.limit_bytes for op in OPERATIONS.values() if op.limit_bytes != SMALL_REQUEST_BYTES}
log = logging.getLogger("edgetb.agent")


def default_token_file() -> str:
    return os.path.join(state_root(), "token")


def token_file_owners() -> set[int]:
    """Who may own a token file: root, this process's user, and the user who ran it through sudo."""
    owners = {0, os.geteuid()}
    if os.environ.get("SUDO_UID", "").isdigit():
        owners.add(int(os.environ["SUDO_UID"]))
    return owners


def read_token_file(path: str) -> str:
    """The token in ``path``; ConfigError when it is missing, short, a symbolic link, owned by
    another user, or open to group or others (a token gives root on its host: mode 0600)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(f"no token file {path}") from None
    except OSError as e:
        why = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise ConfigError(f"cannot read the token file {path}: {why}") from None
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"the token file {path} is not a regular file")
        if st.st_uid not in token_file_owners():
            raise ConfigError(f"the token file {path} belongs to uid {st.st_uid}, not to root or to you: "
                              f"another user may know it")
        mode = st.st_mode
        if mode & 0o077:
            raise ConfigError(f"the token file {path} is open to other users (mode {mode & 0o777:o}): "
                              f"chmod 600 {path}")
        token = f.read().strip()
    return check_token(token, path)


def write_token_file(path: str) -> str:
    """A new random token in a new file ``path`` (mode 0600; its directory made 0700)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), mode=0o700, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def load_token(path: Optional[str] = None, create: bool = True) -> str:
    """The agent's token: from ``path`` when given (never overridden), else $EDGETB_TOKEN, else the
    state directory's token file (made when missing and ``create``)."""
    if path:
        return read_token_file(path)
    if os.environ.get("EDGETB_TOKEN"):
        return check_token(os.environ["EDGETB_TOKEN"], "EDGETB_TOKEN")
    path = default_token_file()
    if not os.path.exists(path):
        if not create:
            raise ConfigError(f"no token: give a token file, or create {path}")
        write_token_file(path)
    return read_token_file(path)


QUERY_INT = Field(str, "a non-negative integer", pattern=re.compile(r"[0-9]{1,18}"), hint="a non-negative integer",
                  parse=int)


def _int_arg(name: str, default: Optional[int]) -> Optional[int]:
    """A non-negative integer query argument."""
    value = request.args.get(name)
    if value is None:
        return default
    return QUERY_INT.check(value, Place("query"), name, ConfigError)


def _body() -> Any:
    """The request's JSON body."""
    data = request.get_json(silent=True)
    if data is None:
        raise ConfigError("request body must be JSON (Content-Type: application/json)")
    return data


def _calling(host: WorkerHost, op: Operation) -> Callable[..., Any]:
    """The view of ``op``: ``host.<op.name>`` called (in a thread) with the path's parameters,
    then the JSON body when the operation takes one."""
    def view(**params: str) -> Any:
        method = getattr(host, op.name)
        return run_blocking(method, *(params[p] for p in op.params), *([_body()] if op.body else []))

    return view


def _special_views(host: WorkerHost) -> dict[str, Callable[..., Any]]:
    """The operations served otherwise: from no thread, by another method or flag, from query
    arguments, or with a stream."""
    def capture_chunks(name: str) -> Response:
        return Response(run_blocking(host.capture_chunks, name), mimetype="application/vnd.tcpdump.pcap")

    return {"health": lambda: {"version": API_VERSION, "ok": True, "testbed_id": host.testbed_id},
            "merge_links": lambda: run_blocking(host.set_links, _body(), True),
            "clear_links": lambda: run_blocking(host.clear_links, request.args.get("node")),
            "telemetry_read": lambda: run_blocking(host.telemetry_read, _int_arg("cursor", 0), _int_arg("limit", None)),
            "capture_chunks": capture_chunks,
            "stop_process": lambda name, proc_id: run_blocking(host.stop_process, name, proc_id, STOP_GRACE_S,
                                                               _int_arg("offset", None)),
            "process_log": lambda name, proc_id: run_blocking(host.process_log, name, proc_id, _int_arg("offset", 0),
                                                              _int_arg("limit", None))}


def _answering(op: Operation, view: Callable[..., Any]) -> Callable[..., Any]:
    """``view``'s answer with ``op``'s status (JSON; a Response, a stream, as it is)."""
    def answer(**params: str) -> Any:
        result = view(**params)
        return result if isinstance(result, Response) else (jsonify(result), op.status)

    return answer


def create_app(host: WorkerHost, token: str) -> Flask:
    """The agent's Flask app: a route per operation of the table (``worker.api.protocol``), each a
    thin wrapper over ``host``."""
    token = check_token(token, "the agent's token")
    app = Flask("edgetb-agent")
    request_limits(app, REQUEST_LIMITS, SMALL_REQUEST_BYTES)

    @app.before_request
    def authenticate() -> None:
        if request.endpoint == "health":
            return
        if not bearer_matches(request.headers.get("Authorization", ""), token):
            raise AuthError("missing or wrong bearer token")

    json_errors(app, log)

    special = _special_views(host)
    unknown = set(special) - set(OPERATIONS)
    if unknown:  # the table and the routes are one API
        raise RuntimeError(f"the agent serves routes the table lacks: {sorted(unknown)}")
    for op in OPERATIONS.values():
        view = special.get(op.name) or _calling(host, op)
        app.add_url_rule(op.path, endpoint=op.name, view_func=_answering(op, view), methods=[op.method])
    return app


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="edgetb-agent", description="edgetb worker agent")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--listen", "--bind", dest="listen", default=DEFAULT_LISTEN,
                        help="address to listen on (default 127.0.0.1; 0.0.0.0 or this host's LAN address to be "
                             "reached from the controller's machine)")
    parser.add_argument("--plain-http", action="store_true",
                        help="serve plain HTTP instead of HTTPS: only on a loopback --listen address")
    parser.add_argument("--print-fingerprint", action="store_true",
                        help="print the SHA-256 fingerprint of the agent's certificate (made if missing) and exit")
    parser.add_argument("--tls-dir", default=None, help="certificate and key directory (default: state dir/tls)")
    parser.add_argument("--id", default=os.environ.get("EDGETB_ID", "0"), help="testbed id (default 0)")
    parser.add_argument("--subnet", default=DEFAULT_SUBNET, help="this host's node subnet")
    parser.add_argument("--token-file", default=None,
                        help="this agent's token, in a file of mode 0600 "
                             "(default: $EDGETB_TOKEN, else state dir/token)")
    parser.add_argument("--runtime", choices=("netns", "docker", "physical"), default=None,
                        help="what a node is: a network namespace, a Docker container, or this device itself "
                             "(default: the kind the testbed's existing nodes are, else netns)")
    parser.add_argument("--workdir", default=None,
                        help="where nodes find dml_app/ and dataset/ (synced from the controller) and write "
                             "their files (default: the testbed's state directory/work)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s agent %(levelname)s %(message)s")
    try:
        if args.print_fingerprint:
            print(tls.pretty(tls.fingerprint_file(tls.ensure_certificate(args.tls_dir)[0])))
            return 0
        if args.plain_http and not is_loopback_host(args.listen):
            raise ConfigError(f"--plain-http is for a loopback address only, not {args.listen}: the token and every "
                              "command would cross the network in clear")
        context, fingerprint = None, None
        if not args.plain_http:
            cert, key = tls.ensure_certificate(args.tls_dir)
            context, fingerprint = tls.server_context(cert, key), tls.pretty(tls.fingerprint_file(cert))
        token = load_token(args.token_file)
        host = WorkerHost(args.id, args.subnet, runtime=args.runtime, workdir=args.workdir)
    except TestbedError as e:
        print(f"edgetb-agent: {e.message}", file=sys.stderr)
        return 2
    try:
        host.schedule.warm()  # a trace's clock process, ready before a run hands it its bins
    except OSError as e:
        log.warning("the trace clock's process did not start (it is tried again at a schedule): %s", e)
    if host.runtime.kind == "docker":
        from worker.nodes import docker as runtime_docker

        problem = runtime_docker.probe(cast(runtime_docker.DockerRuntime, host.runtime).image)
        if problem:
            log.warning("Docker nodes cannot be created yet: %s", problem)
    scheme = "http" if args.plain_http else "https"
    where = f"[{args.listen}]" if ":" in args.listen else args.listen

    def listening() -> None:  # said once the port is bound: callers wait for this line
        log.info("agent listening on %s://%s:%d (%s nodes)", scheme, where, args.port, host.runtime.kind)
        if fingerprint:
            log.info("TLS certificate SHA-256 fingerprint (hosts.json 'tls_fingerprint'): %s", fingerprint)

    serve(create_app(host, token), args.port, args.listen, log, ssl_context=context, on_listening=listening)
    return 0


if __name__ == "__main__":
    sys.exit(main())
