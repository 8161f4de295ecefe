"""After a run: every node's final model, evaluated on the run's global test set and saved
as safetensors.

A node leaves its final weights in ``dml_file/node/<name>/<run id>.weights``
(the weights wire format of ``dml_app.wire.weights``). Those files are written by
nodes, so they are untrusted: read without following links, opened non-blocking
and only when a regular file of one link owned by the node's uid, refused above a
size limit, parsed without pickle (JSON header nesting bounded), checked against the model the node's conf
describes (layer count, shapes) and for finite values. The model is rebuilt with
the nodes' own code (``dml_app.models.make.make_model``), so the controller measures
exactly what the nodes measured: a numpy built-in here, a Keras or user model in the
probe sandbox (``controller.sandbox``). Each model is written to
``<run dir>/models/<node>.safetensors``: tensors named by layer as the node sent them
(``conv2d/kernel``...; else ``layers.<k>.kernel`` and ``layers.<k>.bias`` for an MLP's,
``arrays.<i>``), a torch module's by its whole ``state_dict`` keys with the integer buffers its
node kept (``load_state_dict(strict=True)`` takes the file as it is), metadata with the node, run
id, model kind and conf, input shape, the tensors' order (a torch module's: its ``state_dict``'s;
and the MLP's layer sizes). A Keras or user model's weights are set into its model in the sandbox before
they are saved (those that do not fit are refused), with or without a global test set.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import numpy as np

from controller.results.run_dir import Writer, local_writer
from controller.results.run_dir import NodeFileError, read_node_file
from dml_app.models.global_test import load_global_test
from controller import sandbox
from controller.confs.usercode import sample_shape
from dml_app.models.make import kind_of, make_model
from dml_app.runtime.usercode import shown
from dml_app.models.numpy.mlp import NumpyMLP
from dml_app.wire import weights as wire
from worker.api.errors import ConfigError

MAX_WEIGHTS_BYTES = 256 * 1024 * 1024  # a final model larger than this is refused
FINAL_THREADS = 8  # final models read, evaluated and written at once (a thousand nodes finish together)


class ModelFileError(ConfigError):
    """A node's final weights file is missing, oversized or malformed."""


def weights_path(workdir: str, node: str, run_id: str) -> str:
    return os.path.join(workdir, "dml_file", "node", node, f"{run_id}.weights")


def read_weights(workdir: str, node: str, run_id: str, max_bytes: int = MAX_WEIGHTS_BYTES,
                 uid: Optional[int] = None) -> tuple[list[np.ndarray], list[Optional[str]]]:
    """The arrays of the final weights file node ``node`` wrote (``controller.results.run_dir.read_node_file``:
    no link followed, a regular file of one link, owned by ``uid`` when given, at most
    ``max_bytes``), in the wire format (no pickle). Raises ModelFileError naming the file."""
    path = weights_path(workdir, node, run_id)
    try:
        data = read_node_file(workdir, node, f"{run_id}.weights", max_bytes, uid)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no final weights (the node did not save a model)") from None
    except NodeFileError as e:
        raise ModelFileError(e.message) from None
    try:
        arrays, _, names = wire.decode_named(data)
    except wire.WeightsFormatError as e:
        raise ModelFileError(f"{path}: not a valid weights file: {e}") from None
    if not arrays:
        raise ModelFileError(f"{path}: holds no arrays")
    return arrays, names


def tensor_names(arrays: list[np.ndarray], names: Optional[list[Optional[str]]] = None) -> list[str]:
    """The layer names the node sent (``names``: each array's, when all are given and distinct), else
    ``layers.<k>.kernel`` / ``layers.<k>.bias`` for (matrix, vector) pairs, else ``arrays.<i>``."""
    if names and all(names) and len(set(names)) == len(arrays):
        return [str(n) for n in names]
    pairs = len(arrays) % 2 == 0 and all(a.ndim == 2 and b.ndim == 1 for a, b in zip(arrays[::2], arrays[1::2]))
    if pairs:
        return [f"layers.{i // 2}.{'kernel' if i % 2 == 0 else 'bias'}" for i in range(len(arrays))]
    return [f"arrays.{i}" for i in range(len(arrays))]


def safetensors_bytes(arrays: list[np.ndarray], metadata: dict[str, str],
                      layer_names: Optional[list[Optional[str]]] = None, order: Optional[list[str]] = None) -> bytes:
    """``arrays`` as a safetensors file (names from ``tensor_names``; their ``order``, by default
    the arrays', in metadata)."""
    from safetensors.numpy import save

    names = tensor_names(arrays, layer_names)
    if order is None or sorted(order) != sorted(names):
        order = names
    return save({n: np.ascontiguousarray(a) for n, a in zip(names, arrays)},
                metadata={**metadata, "tensor_order": json.dumps(order)})


def load_safetensors(path: str) -> tuple[list[np.ndarray], dict[str, str]]:
    """The arrays of a file ``final_models`` wrote, in their order, and its metadata."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        metadata = f.metadata() or {}
        names = json.loads(metadata["tensor_order"]) if "tensor_order" in metadata else sorted(f.keys())
        return [f.get_tensor(n) for n in names], metadata


def final_models(workdir: str, run_dir: str, run_id: str, structure: dict[str, dict[str, Any]],
                 dataset_confs: dict[str, dict[str, Any]], max_bytes: int = MAX_WEIGHTS_BYTES,
                 write: Optional[Writer] = None, uids: Optional[dict[str, int]] = None) -> dict[str, dict[str, Any]]:
    """Evaluate and save every node's final model.

    ``structure``: each node's structure conf (its ``model`` entry builds the model);
    ``dataset_confs``: each node's dataset conf (``shard``, ``n_classes``, and ``global_test``: the
    global set's path relative to ``workdir``). Returns, per node of ``structure``:
    ``{"global_accuracy", "global_loss", "model": <safetensors path>, "error"}`` (accuracy
    and loss None without a global set; ``model`` None and ``error`` set when the node's
    file is missing or refused). Never raises for one node's bad file. ``write`` (relative
    path, bytes) writes ``models/<node>.safetensors``; by default into ``run_dir``. ``uids``: each
    node's uid where known (its file must be its own). A numpy built-in model is rebuilt here;
    a Keras or user model (code the controller does not run as root) in the probe sandbox."""
    write = write or local_writer(run_dir)
    test_sets: dict[tuple[str, tuple[int, ...], int], Any] = {}
    loading = threading.Lock()
    out: dict[str, dict[str, Any]] = {}
    # a Keras or user model's nodes, by their model, shape, classes and test set (as JSON): their arrays
    elsewhere: dict[str, list[tuple[str, list[np.ndarray], list[Optional[str]], dict[str, str]]]] = {}

    def test_set(key: tuple[str, tuple[int, ...], int]) -> Any:
        with loading:  # (read once, whichever thread asks first)
            if key not in test_sets:
                test_sets[key] = _global_set(workdir, *key)
            return test_sets[key]

    def one(node: str) -> Optional[tuple[str, tuple[str, list[np.ndarray], list[Optional[str]], dict[str, str]]]]:
        """Node ``node``'s model evaluated and saved here (numpy built-ins), or what the sandbox is to do."""
        entry = out[node]
        try:
            arrays, layer_names = read_weights(workdir, node, run_id, max_bytes, (uids or {}).get(node))
            if not all(np.isfinite(a).all() for a in arrays if a.dtype.kind == "f"):
                raise ModelFileError(f"{node}: the final weights hold NaN or infinite values")
            model_conf = dict(structure[node].get("model") or {})
            dconf = dataset_confs.get(node) or {}
            if dconf.get("shard") or dconf.get("global_test"):
                input_shape, n_classes = sample_shape(workdir, dconf)
            elif arrays[0].ndim == 2:  # an MLP's, without its data: its first layer says
                input_shape, n_classes = (int(arrays[0].shape[0]),), int(dconf.get("n_classes") or arrays[-1].shape[-1])
            else:
                raise ModelFileError(f"{node}: its dataset conf names no data to take the model's input shape from")
            recorded = {**model_conf, "kind": kind_of(model_conf)}  # (as run.json records it: the user's path)
            if recorded.get("module"):
                recorded["module"] = shown(str(recorded["module"]))
            meta = {"format": "edgetb-model", "node": node, "run_id": run_id, "kind": recorded["kind"],
                    "model": json.dumps(recorded), "input_shape": json.dumps(list(input_shape))}
            if model_conf.get("module") or kind_of(model_conf) != "numpy":  # checked and evaluated in the sandbox
                key = json.dumps([model_conf, input_shape, n_classes, str(dconf.get("global_test") or "")])
                return key, (node, arrays, layer_names, meta)
            model = make_model(model_conf, input_shape, n_classes)
            try:
                model.set_weights(arrays)
            except ValueError as e:
                raise ModelFileError(f"{node}: the final weights do not fit the model of its conf: {e}") from None
            if isinstance(model, NumpyMLP):
                meta.update(format="edgetb-mlp", sizes=json.dumps(model.sizes))
            relative = f"models/{node}.safetensors"
            write(relative, safetensors_bytes(arrays, meta, layer_names))
            entry["model"] = os.path.join(run_dir, relative)
            if dconf.get("global_test"):
                x, y = test_set((str(dconf["global_test"]), input_shape, n_classes))
                loss, accuracy = model.evaluate(x, y)
                entry["global_loss"], entry["global_accuracy"] = round(float(loss), 6), round(float(accuracy), 6)
        except (ModelFileError, ValueError, ConfigError) as e:
            entry["error"] = str(e) if not isinstance(e, ConfigError) else e.message
        except Exception as e:  # noqa: BLE001 - one node's file never stops the others' models
            entry["error"] = f"{node}: {type(e).__name__}: {e}"
        return None

    nodes = sorted(structure)
    for node in nodes:
        out[node] = {"global_accuracy": None, "global_loss": None, "model": None, "error": None}
    with ThreadPoolExecutor(max_workers=FINAL_THREADS) as pool:  # reading, evaluating, fsync: overlapped
        for found in pool.map(one, nodes):
            if found is not None:
                elsewhere.setdefault(found[0], []).append(found[1])
    for key, nodes in elsewhere.items():
        model_conf, input_shape, n_classes, test = json.loads(key)
        try:
            results = sandbox.evaluate_models(model_conf, workdir, input_shape, n_classes, test,
                                              [arrays for _, arrays, _, _ in nodes])
        except ConfigError as e:
            results = [{"error": e.message}] * len(nodes)
        for (node, arrays, layer_names, meta), result in zip(nodes, results):
            if result.get("error"):
                out[node]["error"] = f"{node}: the final weights do not fit the model of its conf: {result['error']}"
                continue
            relative = f"models/{node}.safetensors"
            names = result.get("names") if isinstance(result.get("names"), list) else layer_names
            write(relative, safetensors_bytes(arrays, meta, names, result.get("order")))
            out[node]["model"] = os.path.join(run_dir, relative)
            if result.get("accuracy") is not None:
                out[node]["global_loss"] = round(float(result["loss"]), 6)
                out[node]["global_accuracy"] = round(float(result["accuracy"]), 6)
    return out


def _global_set(workdir: str, relative: str, input_shape: tuple[int, ...], n_classes: int
                ) -> tuple[np.ndarray, np.ndarray]:
    root = os.path.realpath(workdir)
    path = os.path.realpath(os.path.join(root, relative))
    if os.path.commonpath([root, path]) != root:
        raise ModelFileError(f"global test set {relative!r} is outside the experiment directory")
    return load_global_test(path, input_shape, n_classes)
