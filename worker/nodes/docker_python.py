"""A Docker node's declared Python: ``"python"`` of nodes.json names a virtual environment
inside the node's image, whose ``bin/`` leads the container's ``PATH``.

``check`` runs before any container of the testbed is made: a throwaway container of the image
(no network, no capabilities, read-only, as the node's uid) is looked into through the engine's
archive API (the environment and its ``bin/python3`` or ``bin/python`` exist) and then runs that
interpreter, which checks it can read the environment. Every refusal is a ConfigError naming the
node and the path; the throwaway container is removed in every case.
"""
from __future__ import annotations

import base64
import json
import uuid
from typing import Any, Optional

from worker.api.errors import ConfigError, NodeRuntimeError
from worker.confinement.node_python import INTERPRETERS, check_path
from worker.confinement.uids import Identity
from worker.nodes.docker_exec import sdk, short_error

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # the engine's, when an image sets none
DIR_BIT = 1 << 31  # Go's os.ModeDir, in the archive API's stat
LINK_BIT = 1 << 27  # os.ModeSymlink
CHECK_TIMEOUT_S = 60
MAX_OUTPUT_BYTES = 4096
# run by the declared interpreter itself (argv[1]: the environment): what it is, and what its uid may read
PROBE = ("import json, os, sys\n"
         "env = sys.argv[1]\n"
         "ok = lambda p: os.access(p, os.R_OK | os.X_OK)\n"
         "print(json.dumps({'version': sys.version.split()[0], 'prefix': sys.prefix, 'env': ok(env),\n"
         "                  'bin': ok(os.path.join(env, 'bin'))}))\n")


def image_path(api: Any, image: str) -> str:
    """The ``PATH`` the image's processes get (the engine's default when the image sets none)."""
    env = (api.inspect_image(image).get("Config") or {}).get("Env") or []
    return next((e[len("PATH="):] for e in env if e.startswith("PATH=")), DEFAULT_PATH)


def _stat(api: Any, container: str, path: str) -> Optional[dict[str, Any]]:
    """The engine's stat of ``path`` in ``container`` (None: it does not exist); intermediate
    links are followed, the last one is not (its ``linkTarget`` says where it leads)."""
    resp = api.head(api._url("/containers/{0}/archive", container), params={"path": path})
    if resp.status_code == 404:
        return None
    header = resp.headers.get("X-Docker-Container-Path-Stat")
    if resp.status_code != 200 or not header:
        raise NodeRuntimeError(f"cannot look at {path} in the image: the engine answered {resp.status_code}")
    return json.loads(base64.b64decode(header))


def _is_dir(api: Any, container: str, path: str, found: dict[str, Any]) -> bool:
    if found["mode"] & LINK_BIT:  # a link to a directory: the engine follows it with a trailing '/.'
        found = _stat(api, container, path.rstrip("/") + "/.") or {"mode": 0}
    return bool(found["mode"] & DIR_BIT)


def check(api: Any, image: str, path: object, node: str, ident: Identity, label: dict[str, str]) -> str:
    """The declared environment ``path`` of ``node``, checked in ``image`` as ``ident`` would use
    it; ``label``: the testbed's labels for the throwaway container (so a reset finds a leftover)."""
    declared = check_path(path, node)
    where = f"node {node!r}: python {declared!r} (in image {image})"
    docker = sdk()
    host = api.create_host_config(network_mode="none", cap_drop=["ALL"], security_opt=["no-new-privileges"],
                                  read_only=True, pids_limit=64, mem_limit=256 << 20)

    def make(interpreter: str) -> str:
        return api.create_container(image, entrypoint=[interpreter, "-I", "-c", PROBE, declared], command=[],
                                    user=f"{ident.uid}:{ident.gid}", labels=label, host_config=host,
                                    network_disabled=True, name=f"{label_name(label)}-pycheck-{uuid.uuid4().hex[:8]}"
                                    )["Id"]

    made: list[str] = []
    try:
        made.append(make(f"{declared}/bin/{INTERPRETERS[0]}"))
        top = _stat(api, made[0], declared)
        if top is None:
            raise ConfigError(f"{where}: does not exist in the image")
        if not _is_dir(api, made[0], declared, top):
            raise ConfigError(f"{where}: not a directory (give a virtual environment's directory, the one holding "
                              "bin/python3)")
        found = next((n for n in INTERPRETERS if _stat(api, made[0], f"{declared}/bin/{n}") is not None), None)
        if found is None:
            raise ConfigError(f"{where}: not a Python environment (no bin/python3 or bin/python in it): create one "
                              "in the image with 'python3 -m venv PATH'")
        interpreter = f"{declared}/bin/{found}"
        if found != INTERPRETERS[0]:
            made.append(make(interpreter))
        container = made[-1]
        try:
            api.start(container)
        except docker.errors.APIError as e:
            raise ConfigError(f"{where}: the node's processes run as uid {ident.uid} and cannot run {interpreter} "
                              f"({short_error(e)})") from None
        try:
            code = api.wait(container, timeout=CHECK_TIMEOUT_S)["StatusCode"]
        except Exception:
            raise ConfigError(f"{where}: {interpreter} did not answer within {CHECK_TIMEOUT_S} s") from None
        out = api.logs(container, stdout=True, stderr=True)[-MAX_OUTPUT_BYTES:].decode("utf-8", "replace")
        try:
            facts = json.loads(out.strip().splitlines()[-1]) if code == 0 else None
        except (ValueError, IndexError):
            facts = None
        if not isinstance(facts, dict):
            raise ConfigError(f"{where}: {interpreter} is not a Python that runs as uid {ident.uid} (exit status "
                              f"{code}: {out.strip()[-300:]!r})")
        for key, what in (("env", "the environment"), ("bin", "its bin/ directory")):
            if facts.get(key) is not True:
                raise ConfigError(f"{where}: the node's processes run as uid {ident.uid} and cannot read {what}: "
                                  "make it readable by others in the image (chmod -R o+rX)")
        return declared
    except docker.errors.ImageNotFound:
        raise ConfigError(f"{where}: the image does not exist") from None
    except docker.errors.APIError as e:
        raise NodeRuntimeError(f"{where}: cannot check it: {short_error(e)}") from None
    finally:
        for container in made:
            try:
                api.remove_container(container, force=True)
            except docker.errors.APIError:
                pass  # gone already; else a reset finds it by its label


def label_name(label: dict[str, str]) -> str:
    """``etb-<testbed id>``: the throwaway containers' name prefix."""
    return "etb-" + "-".join(label.values())
