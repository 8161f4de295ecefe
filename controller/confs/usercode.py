"""The user's own files (a model, an algorithm) staged for the nodes and tried before a run.

``stage`` copies each file a structure names, with the Python files beside it (``helpers``: what
it may import), into ``dml_user/`` of the experiment directory (a snapshot: editing the file during
a run changes nothing; the directory is synced to other hosts like the code) and points the
nodes' confs at the copy. ``check`` tries them in the probe sandbox (``controller.sandbox``): a
model that does not build, breaks the contract, builds arrays of different shapes with different
seeds or different initial weights from the same seed (its kind inferred when the entry names
none), an algorithm class that is not a role, and a policy
class that is not a ``dml_app.policies.Policy`` or whose first vote is not one, are refused with the
file and the reason before anything is created. Built-in models are checked too: a
numpy one is built here (it is the project's own code), a Keras one needs TensorFlow.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import stat
import zipfile
from typing import Any, Optional

import numpy as np

from dml_app.models.architectures import architecture
from dml_app.models.contract import FRAMEWORKS
from dml_app.models.make import kind_of, make_model
from dml_app.runtime.usercode import USERCODE_DIR, shown
from worker.api.errors import ConfigError
from worker.confinement.facade import under

MAX_USER_FILE_BYTES = 1 << 20
MAX_HELPER_FILES = 256  # Python files staged beside a user's file
TESTBED_DIRS = ("controller", "worker", "dml_app", "dml_tool", "tests", "bench", USERCODE_DIR, "dml_file")


def user_files(structure: dict[str, dict[str, Any]]) -> list[str]:
    """The user's files the confs name (relative to the experiment directory), each once."""
    found = []
    for conf in structure.values():
        for entry in (conf.get("model") or {}, conf.get("algorithm") or {}, *(conf.get("policies") or [])):
            if entry.get("module"):
                found.append(str(entry["module"]))
    return list(dict.fromkeys(found))


def stage(workdir: str, structure: dict[str, dict[str, Any]], source: str) -> dict[str, str]:
    """Copy the user's files into ``dml_user/`` and point ``structure``'s confs at the copies;
    returns {relative path: the staged copy}. ``source``: the structure file, for errors. A file
    must lie in the experiment directory, outside the testbed's own ``dml_user/`` and ``dml_file/``;
    ``dml_user/`` must be a directory, not a link (root writes there)."""
    root = os.path.realpath(workdir)
    sources = {}
    for relative in user_files(structure):
        path = os.path.realpath(os.path.join(root, relative))
        if not under(path, root):
            raise ConfigError(f"{source}: {relative!r} is outside the experiment directory {root}")
        if any(under(path, os.path.join(root, own)) for own in (USERCODE_DIR, "dml_file")):
            raise ConfigError(f"{source}: {relative!r} is in the testbed's own {USERCODE_DIR}/ or dml_file/")
        try:
            with open(path, "rb") as f:
                data = f.read(MAX_USER_FILE_BYTES + 1)
        except (FileNotFoundError, IsADirectoryError):
            raise ConfigError(f"{source}: {relative}: no such file in the experiment directory {root}") from None
        except OSError as e:
            raise ConfigError(f"{source}: {relative}: cannot be read: {e.strerror}") from None
        if len(data) > MAX_USER_FILE_BYTES:
            raise ConfigError(f"{source}: {relative}: larger than {MAX_USER_FILE_BYTES} bytes")
        sources[relative] = data
    for relative in list(sources):
        for beside, data in helpers(root, relative, source).items():
            sources.setdefault(beside, data)
    staged_root = os.path.join(root, USERCODE_DIR)
    try:
        st = os.lstat(staged_root)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"{staged_root} is not a directory: remove it (the testbed stages the user's code there)")
    if st is None and sources:
        os.mkdir(staged_root, 0o755)
    if st is not None:  # the directory is kept (a container mounts it), the last run's files not
        for entry in os.scandir(staged_root):
            shutil.rmtree(entry.path) if entry.is_dir(follow_symlinks=False) else os.unlink(entry.path)
    staged = {}
    for relative, data in sources.items():
        target = os.path.join(staged_root, relative)
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(target, 0o644)
        staged[relative] = target
    for conf in structure.values():
        for key in ("model", "algorithm"):
            entry = conf.get(key)
            if entry and entry.get("module"):
                conf[key] = {**entry, "module": f"{USERCODE_DIR}/{entry['module']}"}
        if conf.get("policies"):
            conf["policies"] = [{**p, "module": f"{USERCODE_DIR}/{p['module']}"} if p.get("module") else p
                                for p in conf["policies"]]
    return staged


def helpers(root: str, relative: str, source: str) -> dict[str, bytes]:
    """The Python files beside the user's file ``relative`` (its directory's ``.py`` files and the
    packages in it, by path relative to ``root``), staged with it so that it can import them; the
    testbed's own directories are left out."""
    folder = os.path.dirname(os.path.join(root, relative))
    found: dict[str, bytes] = {}
    for path in _python_files(folder, top=True, root=root):
        rel = os.path.relpath(path, root)
        try:
            with open(path, "rb") as f:
                found[rel] = f.read(MAX_USER_FILE_BYTES + 1)
        except OSError:
            continue  # (unreadable: not the user's named file, so not an error)
        if len(found[rel]) > MAX_USER_FILE_BYTES or len(found) > MAX_HELPER_FILES:
            raise ConfigError(f"{source}: {relative}: the Python files beside it, staged with it, are more than "
                              f"{MAX_HELPER_FILES} or one is larger than {MAX_USER_FILE_BYTES} bytes "
                              f"({rel}): keep a model's or an algorithm's files in a directory of their own")
    return found


def _python_files(folder: str, top: bool, root: str) -> list[str]:
    """``folder``'s ``.py`` files and those of its packages (directories with ``__init__.py``), not
    through links out of ``root`` nor into the testbed's own directories."""
    out = []
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return out
    for entry in entries:
        real = os.path.realpath(entry.path)
        if entry.name.startswith(".") or not under(real, root):
            continue
        if entry.is_file() and entry.name.endswith(".py"):
            out.append(entry.path)
        elif (entry.is_dir() and os.path.isfile(os.path.join(entry.path, "__init__.py"))
              and not (top and os.path.realpath(folder) == root and entry.name in TESTBED_DIRS)):
            out += _python_files(entry.path, False, root)
    return out


def sample_shape(workdir: str, dataset_conf: dict[str, Any]) -> tuple[tuple[int, ...], int]:
    """(a sample's shape, classes) of a node's shard (or of the global test set, when it has one),
    from the arrays' headers (no data read)."""
    if dataset_conf.get("global_test") and dataset_conf.get("n_classes"):
        relative, member = str(dataset_conf["global_test"]), "x.npy"
    else:
        relative, member = str(dataset_conf.get("shard")), "x_train.npy"
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.join(root, relative))
    if not under(path, root):
        raise ConfigError(f"{relative!r} is outside the experiment directory")
    try:
        with zipfile.ZipFile(path) as z, z.open(member) as f:
            major, _ = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
            shape = read_header(f)[0]
    except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
        raise ConfigError(f"{path}: cannot read the shard: {e}") from None
    n_classes = dataset_conf.get("n_classes")
    if not n_classes:
        with np.load(path, allow_pickle=False) as shard:
            n_classes = int(shard["y_train"].max(initial=0)) + 1
    return tuple(int(d) for d in shape[1:]), int(n_classes)


def check(workdir: str, structure: dict[str, dict[str, Any]], dataset_confs: dict[str, dict[str, Any]],
          source: str, runtimes: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Try every model and algorithm of ``structure`` (staged) on the nodes' sample shape; returns
    each distinct model's description (arrays, params, bytes). A refusal is a ConfigError.
    ``runtimes``: each node's (netns, docker, physical), where known."""
    from controller import sandbox

    described: dict[str, Any] = {}
    tried: set[str] = set()
    docker = sorted(n for n, r in (runtimes or {}).items() if r == "docker")
    for node, conf in structure.items():
        model = dict(conf.get("model") or {})
        shape, n_classes = sample_shape(workdir, dataset_confs[node])
        key = json.dumps([{k: v for k, v in model.items() if k != "seed"}, shape, n_classes], sort_keys=True)
        if key in tried:
            continue
        tried.add(key)
        sharing = [n for n, c in structure.items() if dict(c.get("model") or {}) == model]
        where = f"{source}: field 'model' of node {node}" + (f" (and {len(sharing) - 1} more)" * (len(sharing) > 1))
        if model.get("module"):
            try:
                described[node] = sandbox.check_model(model, workdir, shape, n_classes)
            except ConfigError as e:
                raise type(e)(f"{where}: {e.message}") from None
            if described[node]["inferred"]:  # every node of this model: the kind its build returns
                for other in structure.values():
                    if other.get("model") == model:
                        other["model"] = {**model, "kind": described[node]["kind"]}
            model = {**model, "kind": described[node]["kind"]}
        kind = kind_of(model)
        framework = FRAMEWORKS.get(kind)
        if framework and docker:
            raise ConfigError(f"{where}: a model of kind '{kind}' needs {framework.name} in the nodes, and the Docker "
                              f"node image has numpy only ({', '.join(docker[:3])}{' ...' if len(docker) > 3 else ''}"
                              "): use a numpy model, or netns nodes")
        if model.get("module"):
            continue
        if framework:
            if importlib.util.find_spec(framework.module) is None:
                raise ConfigError(f"{where}: a model of kind '{kind}' needs {framework.name}: pip install '.[{framework.extra}]'")
            try:  # the layers fit the samples (the same description builds the numpy net): no TensorFlow here
                architecture(str(model.get("name") or "mlp"), shape, n_classes, model)
            except ValueError as e:
                raise ConfigError(f"{where}: {e} (samples of shape {shape}, {n_classes} classes)") from None
        else:
            try:
                weights = make_model(model, shape, n_classes).get_weights()
            except ValueError as e:
                raise ConfigError(f"{where}: {e} (samples of shape {shape}, {n_classes} classes)") from None
            described[node] = {"params": int(sum(w.size for w in weights)),
                               "bytes": int(sum(w.nbytes for w in weights))}
    algorithms = {json.dumps(c["algorithm"], sort_keys=True): c["algorithm"] for c in structure.values()
                  if c.get("algorithm")}
    roles = {c["role"] for c in structure.values()}
    for algorithm in algorithms.values():
        replaces = sandbox.check_algorithm(algorithm["module"], algorithm["classes"], workdir)
        unused = sorted(name for name, role in replaces.items() if role not in roles)
        if unused:
            raise ConfigError(f"{source}: field 'algorithm': {', '.join(unused)} replace "
                              f"{', '.join(sorted({replaces[n] for n in unused}))}, a role no node of this "
                              f"structure has ({', '.join(sorted(roles))})")
    check_policies(workdir, structure, source)
    return described


def uses(structure: dict[str, dict[str, Any]], models: dict[str, Any], dataset: dict[str, Any]) -> list[str]:
    """One line per user file in use (checked: ``models`` as ``check`` described them; ``dataset``:
    the dataset settings), for the console."""
    source = dataset.get("dataset")
    lines = [f"your data: {source['module']}, {source.get('function') or 'load'}()"] if isinstance(source, dict) else []
    if isinstance(source, str) and source.endswith(".npz"):
        lines.append(f"your data: {source}")
    for node, model in models.items():
        entry = structure[node].get("model") or {}
        if entry.get("module"):
            inferred = " (inferred from what it returns: write \"kind\" to say so)" if model.get("inferred") else ""
            lines.append(f"your model: {shown(entry['module'])}, {entry.get('build') or 'build'}(), "
                         f"kind {model['kind']}{inferred}")
    for algorithm in {json.dumps(c["algorithm"], sort_keys=True): c["algorithm"] for c in structure.values()
                      if c.get("algorithm")}.values():
        lines.append(f"your algorithm: {shown(algorithm['module'])}, {', '.join(algorithm['classes'])} "
                     f"replacing the built-in role{'s' if len(algorithm['classes']) > 1 else ''}")
    policies = {json.dumps(p, sort_keys=True): p for c in structure.values() for p in c.get("policies") or []
                if p.get("module")}
    lines += [f"your policy: {shown(p['module'])}, {p['class']}" for p in policies.values()]
    return lines


def policy_view(node: str, conf: dict[str, Any]) -> dict[str, Any]:
    """The ``dml_app.policies.PolicyView`` (as keywords) a policy of ``node`` is tried with: the
    members it decides with (a ring's members, else the node alone), the ring's strategy and sites."""
    return {"name": "probe", "role": str(conf["role"]), "members": list(conf.get("ring") or [node]),
            "strategy": conf.get("strategy"), "batch_size": 32, "sites": dict(conf.get("sites") or {})}


def check_policies(workdir: str, structure: dict[str, dict[str, Any]], source: str) -> None:
    """Try each user policy of ``structure`` (staged) in the sandbox, once per role that runs it: the
    class is a Policy, it builds with its conf, and its vote on a sample round is one."""
    from controller import sandbox

    tried: set[str] = set()
    for node, conf in structure.items():
        for i, entry in enumerate(conf.get("policies") or []):
            if not entry.get("module"):
                continue
            view = policy_view(node, conf)
            key = json.dumps([entry, view["role"]], sort_keys=True)
            if key in tried:
                continue
            tried.add(key)
            try:
                sandbox.check_policy(entry, view, workdir)
            except sandbox.ProbeError as e:
                raise sandbox.ProbeError(f"{source}: policies[{i}]: {e}") from None
