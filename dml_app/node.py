"""What runs inside a node: an HTTP service (gevent) that takes confs and runs a role.

    python3 -m dml_app.node --name n1 --controller http://10.77.0.1:3333 --run-id RUN --workdir DIR

Endpoints: ``GET /health``, ``POST /conf/dataset``, ``POST /conf/structure``,
``POST /prepare`` (build the role), ``POST /start``, ``GET /log`` (the node's events), ``POST /stop``, and the
role's own (``POST /gossip`` ...), and ``POST /relay`` (pass a message on to a
node this one's peers have no link to). When the role's rounds are done the
node saves its final weights, uploads its events to the controller's ``/log``
(unless its structure conf says ``"upload_log": false``: a controller on the node's machine
reads them from the node's file) and keeps serving until stopped. Training and evaluation run on a thread of
their own (``dml_app.runtime.compute``): a node that trains still takes peers' models,
relays and answers the controller.

Identity (``dml_app.runtime.auth``): the node's own secret comes in its environment
(``EDGETB_NODE_SECRET``); only the controller's calls signed with a key derived
from it reach the conf, prepare, start, stop and log routes, and the node signs
its ``/print`` and ``/log`` calls with another. The structure conf brings pair keys
for the peers it exchanges messages with, sealed with its own secret; a role route takes a message only when
signed by one of them. Only ``/health`` is public.
"""
from __future__ import annotations

if __name__ == "__main__":  # as a node process only: importing this module patches nothing
    import sys

    # Nodes speak plain HTTP: keeping ssl (libssl, libcrypto) out of the startup imports
    # saves about 4 MiB of RSS per node. Code that needs ssl later may import it.
    sys.modules["ssl"] = None  # type: ignore[assignment]
    import gevent.events

    # no gevent plugins here: skip scanning every installed package's entry points
    # (importlib.metadata and the email parser, about 1.5 MiB)
    gevent.events.notify_and_call_entry_points = gevent.events.notify
    from gevent import monkey

    monkey.patch_all(ssl=False)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import sys  # noqa: E402
import zlib  # noqa: E402
from typing import Any, Optional  # noqa: E402

import gevent  # noqa: E402
import gevent.event  # noqa: E402
import numpy as np  # noqa: E402
from gevent.pywsgi import WSGIServer  # noqa: E402

from dml_app.models.global_test import load_global_test  # noqa: E402
from dml_app.models import samples  # noqa: E402
from dml_app.models.make import make_model  # noqa: E402
from dml_app.roles.base import Context, Role, ok  # noqa: E402
from dml_app.roles.registry import ROLES, role_class  # noqa: E402
from dml_app.runtime.auth import SECRET_ENV, NodeKeys  # noqa: E402
from dml_app.runtime.compute import ComputeThread  # noqa: E402
from dml_app.runtime.events import EventLog  # noqa: E402
from dml_app.runtime.http import JSON, HttpError, Request, Response, Router, json_response, request  # noqa: E402
from dml_app.wire.weights import encode as encode_weights  # noqa: E402

if __name__ == "__main__" and sys.modules.get("ssl", 0) is None:
    del sys.modules["ssl"]

DEFAULT_PORT = 4444
CONF_BODY_BYTES = 4 * 1024 * 1024  # a structure conf lists peers, their addresses and keys
MAX_START_DELAY_S = 60.0  # the longest a /start may defer the role's start


def digest(weights: list[np.ndarray]) -> str:
    """CRC-32 of a model's arrays (their bytes in order), in hex: equal on nodes that start alike
    (a fingerprint, not a signature: zlib is loaded anyway, OpenSSL is kept out of nodes)."""
    crc = 0
    for w in weights:
        crc = zlib.crc32(np.ascontiguousarray(w).tobytes(), crc)
    return f"{crc:08x}"


def confined(workdir: str, relative: str) -> str:
    """``relative`` resolved inside ``workdir``; anything that escapes it is refused."""
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise HttpError(400, "bad_path", f"{relative!r} is outside the experiment directory")
    return path


class NodeService:
    """One node's state: its confs, its role, its events."""

    def __init__(self, name: str, controller: str, run_id: str, workdir: str, port: int) -> None:
        self.name, self.controller, self.run_id, self.workdir, self.port = name, controller.rstrip("/"), run_id, workdir, port
        self.keys: Optional[NodeKeys] = NodeKeys.from_env(name)
        os.environ.pop(SECRET_ENV, None)  # not inherited by anything this process starts
        self.events = EventLog(os.path.join(workdir, "dml_file", "node", name, f"{run_id}.jsonl"), run_id, name)
        self.weights_path = os.path.join(workdir, "dml_file", "node", name, f"{run_id}.weights")
        self.dataset_conf: Optional[dict[str, Any]] = None
        self.structure_conf: Optional[dict[str, Any]] = None
        self.role: Optional[Role] = None
        self.initial_weights = ""  # digest of the model as built, before the first round
        self.role_class: type[Role] = Role
        self.role_ready = gevent.event.Event()
        self.state = "waiting"
        self.router = Router(lambda: self.keys, name)
        self.router.add("GET", "/health", self.health, "public")
        self.router.add("POST", "/conf/dataset", self.conf_dataset, "controller", 64 * 1024)
        self.router.add("POST", "/conf/structure", self.conf_structure, "controller", CONF_BODY_BYTES)
        self.router.add("POST", "/prepare", self.prepare, "controller")
        self.router.add("POST", "/start", self.start, "controller")
        self.router.add("GET", "/log", self.log, "controller")
        self.router.add("POST", "/stop", self.stop, "controller")
        self.router.add("POST", "/relay", lambda req: self._started_role().relay(req), "hop", self._weights_limit)

    # endpoints --------------------------------------------------------------------------
    def health(self, req: Request) -> Response:
        return json_response({"node": self.name, "state": self.state, "dataset_conf": self.dataset_conf is not None,
                              "structure_conf": self.structure_conf is not None})

    def conf_dataset(self, req: Request) -> Response:
        conf = _conf(req, ("shard",))
        if not os.path.isfile(confined(self.workdir, conf["shard"])):
            raise HttpError(400, "bad_conf", f"shard {conf['shard']!r} does not exist")
        self.dataset_conf = conf
        return ok()

    def conf_structure(self, req: Request) -> Response:
        conf = _conf(req, ("role", "sync", "connect"))
        if conf["role"] not in ROLES:
            raise HttpError(400, "bad_conf", f"unknown role {conf['role']!r}; known: {', '.join(ROLES)}")
        if self.state != "waiting":
            raise HttpError(409, "running", f"the node is already {self.state}")
        if "peer_keys" in conf:
            raise HttpError(400, "bad_conf", "peer_keys: pair keys arrive sealed (sealed_peer_keys), never in clear")
        sealed = conf.pop("sealed_peer_keys", {})
        if not isinstance(sealed, dict):
            raise HttpError(400, "bad_conf", "sealed_peer_keys must map peers to hex keys")
        assert self.keys is not None  # (the router lets no controller call through without keys)
        try:
            self.keys.open_peer_keys(sealed)
        except ValueError as e:
            raise HttpError(400, "bad_conf", f"sealed_peer_keys: {e}") from None
        try:
            role = role_class(conf, self.workdir)
        except ValueError as e:
            raise HttpError(400, "bad_conf", str(e)) from None
        self.structure_conf, self.role_class = conf, role
        for method, path in role.ROUTES:  # peers may call before this node starts
            limit = 64 * 1024 if path in role.SMALL_ROUTES else self._weights_limit
            self.router.add(method, path, lambda req, key=(method, path): self._role_call(key, req), "peer", limit,
                            early=lambda req, key=(method, path): self.role.early_answer(key, req) if self.role else None)
        return ok()

    def _weights_limit(self) -> int:
        """The largest body a weights route takes: sized from the model, once the role is built."""
        return self._started_role().body_limit()

    def _started_role(self) -> Role:
        """The role, once /start has built it (peers may call a little earlier: wait briefly)."""
        if not self.role_ready.wait(timeout=120) or self.role is None:
            raise HttpError(503, "not_started", "the node's role has not started")
        return self.role

    def _role_call(self, key: tuple[str, str], req: Request) -> Response:
        return self._started_role().routes()[key](req)

    def prepare(self, req: Request) -> Response:
        """Load the shard and build the model and role, without running it yet (so that a
        run's first round does not include its peers' set-up)."""
        if self.role is None:
            if self.dataset_conf is None or self.structure_conf is None:
                raise HttpError(409, "not_ready", "the node needs its dataset and structure confs first")
            with np.load(confined(self.workdir, self.dataset_conf["shard"]), allow_pickle=False) as shard:
                data = (samples.unpack(shard["x_train"]), shard["y_train"], samples.unpack(shard["x_test"]),
                        shard["y_test"])
            input_shape = tuple(data[0].shape[1:])
            n_classes = int(self.dataset_conf.get("n_classes", int(data[1].max()) + 1))
            global_test = None
            try:
                model = make_model(self.structure_conf.get("model", {}), input_shape, n_classes, self.workdir)
                self.initial_weights = digest(model.get_weights())
                if self.dataset_conf.get("global_test"):  # the run's common test set, the same for every node
                    global_test = load_global_test(confined(self.workdir, str(self.dataset_conf["global_test"])),
                                                   input_shape, n_classes)
                ctx = Context(self.name, model, data, self.structure_conf, self.dataset_conf, self.events,
                              self.progress, self.port, auth=self.keys, global_test=global_test,
                              compute=ComputeThread().run, workdir=self.workdir)
                self.role = self.role_class(ctx)  # (a user's class may refuse its parameters: ValueError)
            except ValueError as e:
                raise HttpError(400, "bad_conf", str(e)) from None
            self.role_ready.set()
            self.state = "prepared"
        return ok({"state": self.state})

    def start(self, req: Request) -> Response:
        """Start the role, ``start_in_s`` (in the body; default 0) after this call: the controller
        starts every node at one moment, not one after another while the first ones already work."""
        if self.state not in ("waiting", "prepared"):
            return ok({"state": self.state})
        body = req.json() if req.body else {}
        delay_s = body.get("start_in_s", 0) if isinstance(body, dict) else None
        if not isinstance(delay_s, (int, float)) or isinstance(delay_s, bool) or not 0 <= delay_s <= MAX_START_DELAY_S:
            raise HttpError(400, "bad_start", f"start_in_s must be a number of seconds from 0 to {MAX_START_DELAY_S:g}")
        self.prepare(req)
        assert self.role is not None
        self.state = "running"
        gevent.spawn(self._run, float(delay_s))
        return ok({"state": self.state})

    def log(self, req: Request) -> Response:
        with open(self.events.path, "rb") as f:
            return 200, "application/x-ndjson", f.read()

    def stop(self, req: Request) -> Response:
        if self.role:
            self.role.ctx.stop.set()
        return ok()

    # running --------------------------------------------------------------------------------
    def _run(self, delay_s: float = 0.0) -> None:
        assert self.role is not None
        gevent.sleep(delay_s)
        data = self.role.ctx.data
        self.events.write("started", role=self.role.name, train_samples=int(len(data[1])), test_samples=int(len(data[3])),
                          initial_weights_crc32=self.initial_weights)
        try:
            result = self.role.run()
            self.save_weights()
            self.state = "done"
            self.events.write("done", **result)
        except Exception as e:  # the run failed: say so, as data
            self.state = "failed"
            self.events.write("failed", detail=f"{type(e).__name__}: {e}")
        if (self.structure_conf or {}).get("upload_log", True):  # else the controller reads the file
            self.upload_log()

    def save_weights(self) -> None:
        """The final model, next to the events (weights wire format): the weights, then the state the
        model keeps to itself (``local_state()``, when it has one: a torch module's integer buffers)."""
        assert self.role is not None
        model = self.role.ctx.model
        arrays, names = model.get_weights(), self.role.weight_names
        local = model.local_state() if callable(getattr(model, "local_state", None)) else {}
        if local:
            names = [*(names or [f"{i:04d}" for i in range(len(arrays))]), *local]
            arrays = [*arrays, *local.values()]
        body = encode_weights(arrays, {"from": self.name, "run_id": self.run_id, "local": len(local)}, names)
        with open(self.weights_path + ".tmp", "wb") as f:
            f.write(body)
        os.replace(self.weights_path + ".tmp", self.weights_path)

    def upload_log(self) -> None:
        with open(self.events.path, "rb") as f:
            body = f.read()
        try:
            # retried for about 3 minutes: when hundreds of nodes end at once, ARP and
            # accept queues overflow (the controller also pulls logs it misses)
            status, answer = request("POST", f"{self.controller}/log", body, "application/x-ndjson",
                                     timeout_s=60, retries=20, backoff_s=1.0, headers=self._signed("/log", body))
            if status >= 400:
                raise ConnectionError(f"{status}: {answer[:200]!r}")
        except ConnectionError as e:
            print(f"{self.name}: could not upload the log: {e}", file=sys.stderr)

    def _signed(self, path: str, body: bytes) -> Any:
        """Headers (a function: fresh for each attempt) that sign a POST to the controller."""
        keys = self.keys
        return lambda: keys.controller_headers("POST", path, body) if keys is not None else {}

    def progress(self, message: str, **fields: Any) -> None:
        def send() -> None:
            body = json.dumps({"msg": message, **fields}).encode()
            try:
                request("POST", f"{self.controller}/print", body, JSON, timeout_s=5,
                        headers=self._signed("/print", body))
            except ConnectionError:
                pass
        gevent.spawn(send)


class NoDelayServer(WSGIServer):
    """Answers go out at once (``TCP_NODELAY``, which accepted connections inherit): a ``100
    Continue`` followed by the answer would otherwise wait for a delayed ACK (about 40 ms)."""

    def init_socket(self) -> None:
        super().init_socket()
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _conf(req: Request, required: tuple[str, ...]) -> dict[str, Any]:
    conf = req.json()
    if not isinstance(conf, dict):
        raise HttpError(400, "bad_conf", "a conf must be a JSON object")
    missing = [k for k in required if k not in conf]
    if missing:
        raise HttpError(400, "bad_conf", f"conf misses {', '.join(missing)}")
    return conf


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="dml_app.node")
    parser.add_argument("--name", required=True)
    parser.add_argument("--controller", required=True, help="controller URL, e.g. http://10.77.0.1:3333")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--workdir", required=True, help="the experiment directory (shards and logs live in it)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--bind", default="0.0.0.0")
    args = parser.parse_args(argv)
    try:
        os.chdir(args.workdir)  # the user's relative paths: the experiment directory's, as in the probe
    except OSError:
        pass
    service = NodeService(args.name, args.controller, args.run_id, args.workdir, args.port)
    server = NoDelayServer((args.bind, args.port), service.router, log=None)
    gevent.signal_handler(signal.SIGTERM, server.stop)
    gevent.signal_handler(signal.SIGINT, server.stop)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
