"""Strict inputs: every file a user writes refuses typos, wrong types and out-of-range values,
naming the file, the place and the field, and nothing is written for a refused input.

Each case goes through ``controller.runner.prepare`` (what gl_run.py and the others run
before touching the network) in a fresh experiment directory holding the repository's
own files, one of them changed.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from controller.confs.confs import dataset_confs, load_dataset, load_structure
from controller.model.hosts import load_hosts
from controller.model.topology import load_links
from controller.runner import parse_options, prepare
from dml_app.models.samples import unpack
from worker.api.errors import ConfigError, TestbedError, TopologyError
from worker.api.schema import Field, Schema, suggestion

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALGORITHMS = {"gl": "gossip", "fl": "fl", "el": "etree", "ra": "ring"}
NODES = [f"n{i}" for i in range(1, 9)]


def _edgetb_dataset() -> dict:
    data = {n: {"train_len": 2, "train_start_index": i + 1, "test_len": 1, "test_start_index": i % 3 + 1,
                "batch_size": 16} for i, n in enumerate(NODES)}
    data["_settings"] = {"shard_size": 100}
    return data


def _base_files() -> dict[str, object]:
    files: dict[str, object] = {}
    for prefix in ALGORITHMS:
        for kind in ("structure", "dataset"):
            with open(os.path.join(REPO, f"{prefix}_{kind}.json")) as f:
                files[f"{prefix}_{kind}.json"] = json.load(f)
    with open(os.path.join(REPO, "links.json")) as f:
        files["links.json"] = json.load(f)
    files["nodes.json"] = {"nodes": [{"name": n, "cpu": 0.5, "mem": "256M"} for n in NODES]}
    files["hosts.json"] = {"hosts": [{"name": "local", "runtime": "netns"}]}
    files["edgetb_dataset.json"] = _edgetb_dataset()
    return files


def _prepare(workdir: str, prefix: str = "gl", dataset: str | None = None) -> None:
    options = parse_options(
        ["--workdir", workdir, "--nodes", "nodes.json", "--hosts", "hosts.json", "--subnet", "10.211.0.0/16"]
        + (["-d", dataset] if dataset else []), ALGORITHMS[prefix], f"{prefix}_structure.json", f"{prefix}_dataset.json")
    prepare(options)


def _experiment(tmp_path, change=None) -> str:
    files = copy.deepcopy(_base_files())
    if change:
        change(files)
    for name, data in files.items():
        (tmp_path / name).write_text(json.dumps(data))
    return str(tmp_path)


def _set(*path, value):
    """A change putting ``value`` at files[path[0]][path[1]]..."""
    def change(files):
        target = files
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value
    return change


def _rename(*path, new):
    """A change renaming the key at files[...][path[-1]] to ``new`` (a typo)."""
    def change(files):
        target = files
        for key in path[:-1]:
            target = target[key]
        target[new] = target.pop(path[-1])
    return change


def _del(*path):
    def change(files):
        target = files
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]
    return change


# (id, algorithm prefix, dataset file or None, change, words the message must hold)
CORPUS = [
    # structure files, all four algorithms
    ("gl entry epochs", "gl", None, _rename("gl_structure.json", "node_list", 2, "epoch", new="epochs"),
     ["gl_structure.json: node_list[2] (n3), field 'epochs': unknown field; did you mean 'epoch'?"]),
    ("gl wiat_s", "gl", None, _rename("gl_structure.json", "wait_s", new="wiat_s"),
     ["gl_structure.json: field 'wiat_s': unknown field; did you mean 'wait_s'?"]),
    ("gl model learning_rte", "gl", None, _rename("gl_structure.json", "model", "learning_rate", new="learning_rte"),
     ["gl_structure.json: model, field 'learning_rte': unknown field; did you mean 'learning_rate'?"]),
    ("gl sync too big", "gl", None, _set("gl_structure.json", "sync", value=10**9),
     ["gl_structure.json: field 'sync'", "[1, 100000]"]),
    ("gl sync true", "gl", None, _set("gl_structure.json", "sync", value=True),
     ["gl_structure.json: field 'sync'", "got true"]),
    ("gl epoch string", "gl", None, _set("gl_structure.json", "node_list", 0, "epoch", value="3"),
     ["node_list[0] (n1), field 'epoch'", "expected an integer", "'3'"]),
    ("gl epoch too big", "gl", None, _set("gl_structure.json", "node_list", 1, "epoch", value=5000),
     ["node_list[1] (n2), field 'epoch'", "1000"]),
    ("gl hidden too wide", "gl", None, _set("gl_structure.json", "model", "hidden", value=[128, 10**6]),
     ["gl_structure.json: model, field 'hidden[1]'", "65536"]),
    ("gl hidden too deep", "gl", None, _set("gl_structure.json", "model", "hidden", value=[8] * 17),
     ["gl_structure.json: model, field 'hidden'", "at most 16"]),
    ("gl learning rate 0", "gl", None, _set("gl_structure.json", "model", "learning_rate", value=0),
     ["model, field 'learning_rate'", "(0, 10]"]),
    ("gl wait_s too long", "gl", None, _set("gl_structure.json", "wait_s", value=10**6),
     ["field 'wait_s'", "86400"]),
    ("gl model kind", "gl", None, _set("gl_structure.json", "model", "kind", value="nunpy"),
     ["model, field 'kind'", "did you mean 'numpy'?"]),
    ("fl qourum", "fl", None, _rename("fl_structure.json", "node_list", 0, "quorum", new="qourum"),
     ["fl_structure.json: node_list[0] (n1), field 'qourum': unknown field; did you mean 'quorum'?"]),
    ("fl deadline too long", "fl", None, _set("fl_structure.json", "node_list", 0, "deadline_s", value=1e7),
     ["node_list[0] (n1), field 'deadline_s'", "86400"]),
    ("fl fraction bool", "fl", None, _set("fl_structure.json", "node_list", 0, "trainer_fraction", value=True),
     ["field 'trainer_fraction'", "got true"]),
    ("fl trainer sync", "fl", None, _set("fl_structure.json", "node_list", 3, "sync", value=5),
     ["fl_structure.json: node_list[3] (n4), field 'sync': unknown field"]),
    ("el child_nun", "el", None, _rename("el_structure.json", "node_list", 1, "child_num", new="child_nun"),
     ["el_structure.json: node_list[1] (n1), field 'child_nun': unknown field; did you mean 'child_num'?"]),
    ("el layer string", "el", None, _set("el_structure.json", "node_list", 4, "layer", value="1"),
     ["node_list[4] (n2), field 'layer'", "expected an integer"]),
    ("el sync too big", "el", None, _set("el_structure.json", "node_list", 0, "sync", value=200000),
     ["node_list[0] (n1), field 'sync'", "100000"]),
    ("ra step_timeout", "ra", None, _rename("ra_structure.json", "step_timeout_s", new="step_timeout"),
     ["ra_structure.json: field 'step_timeout': unknown field; did you mean 'step_timeout_s'?"]),
    ("ra sync negative", "ra", None, _set("ra_structure.json", "sync", value=-1), ["field 'sync'", "got -1"]),
    # dataset files: the settings format
    ("dataset alhpa", "gl", None, _set("gl_dataset.json", "alhpa", value=0.5),
     ["gl_dataset.json: field 'alhpa': unknown field; did you mean 'alpha'?"]),
    ("dataset batch too big", "gl", None, _set("gl_dataset.json", "batch_size", value=10**7),
     ["gl_dataset.json: field 'batch_size'", "65536"]),
    ("dataset alpha 0", "fl", None, _set("fl_dataset.json", "alpha", value=0), ["fl_dataset.json: field 'alpha'"]),
    ("dataset name", "gl", None, _set("gl_dataset.json", "dataset", value="digit"),
     ["field 'dataset'", "did you mean 'digits'?"]),
    ("dataset global_test_size", "gl", None, _set("gl_dataset.json", "global_test_size", value=0),
     ["field 'global_test_size'"]),
    # dataset files: EdgeTB's per-node format
    ("edgetb train_lne", "gl", "edgetb_dataset.json", _rename("edgetb_dataset.json", "n3", "train_len", new="train_lne"),
     ["edgetb_dataset.json: node 'n3', field 'train_lne': unknown field; did you mean 'train_len'?"]),
    ("edgetb extra node", "gl", "edgetb_dataset.json", _set("edgetb_dataset.json", "n9", value=dict(
        train_len=1, train_start_index=1, test_len=1, test_start_index=1)),
     ["edgetb_dataset.json: node 'n9': not a node of the structure file"]),
    ("edgetb missing node", "gl", "edgetb_dataset.json", _del("edgetb_dataset.json", "n8"),
     ["edgetb_dataset.json: no entry for node n8"]),
    ("edgetb index 0", "gl", "edgetb_dataset.json", _set("edgetb_dataset.json", "n1", "train_start_index", value=0),
     ["node 'n1', field 'train_start_index'", "got 0"]),
    ("edgetb window past the end", "gl", "edgetb_dataset.json",
     _set("edgetb_dataset.json", "n2", "train_start_index", value=14),
     ["node 'n2', field 'train_len': shards 14..15 asked, but there are 14"]),
    ("edgetb settings typo", "gl", "edgetb_dataset.json", _rename("edgetb_dataset.json", "_settings", "shard_size",
                                                                   new="shard_sise"),
     ["edgetb_dataset.json: _settings, field 'shard_sise': unknown field; did you mean 'shard_size'?"]),
    ("edgetb setting at the top", "gl", "edgetb_dataset.json", _set("edgetb_dataset.json", "shard_size", value=50),
     ["node 'shard_size': expected an object", "go in '_settings'"]),
    # hosts file
    ("hosts runtme", "gl", None, _rename("hosts.json", "hosts", 0, "runtime", new="runtme"),
     ["hosts.json: hosts[0] (local), field 'runtme': unknown field; did you mean 'runtime'?"]),
    ("hosts controler_ip", "gl", None, _set("hosts.json", "controler_ip", value="10.0.0.1"),
     ["hosts.json: field 'controler_ip': unknown field; did you mean 'controller_ip'?"]),
    ("hosts fingerprint", "gl", None, _set("hosts.json", "hosts", 0, "tls_fingerprint", value="ab:cd"),
     ["hosts.json: hosts[0] (local), field 'tls_fingerprint'", "64 hex digits"]),
    # nodes file
    ("nodes cpus", "gl", None, _rename("nodes.json", "nodes", 2, "cpu", new="cpus"),
     ["nodes.json: nodes[2], field 'cpus': unknown field; did you mean 'cpu'?"]),
    ("nodes cpu too many", "gl", None, _set("nodes.json", "nodes", 0, "cpu", value=5000),
     ["nodes.json: node 'n1', field 'cpu'", "1024"]),
    ("nodes knid", "gl", None, _set("nodes.json", "nodes", 1, "knid", value="emulated"),
     ["field 'knid': unknown field; did you mean 'kind'?"]),
    # links.json
    ("links dleay", "gl", None, _set("links.json", "n1", 0, "dleay", value="10ms"),
     ["links.json: node 'n1', link 0, field 'dleay': unknown field; did you mean 'delay'?"]),
    ("links queue too long", "gl", None, _set("links.json", "n2", 1, "queue", value=10**9),
     ["links.json: node 'n2', link 1 (to 'n1'), field 'queue'"]),
    ("links bw number", "gl", None, _set("links.json", "n3", 0, "bw", value=5),
     ["links.json: node 'n3', link 0 (to 'n4'), field 'bw'", "expected a string"]),
]


def test_the_corpus_is_large_and_covers_every_file():
    assert len(CORPUS) >= 20
    named = " ".join(" ".join(words) for *_, words in CORPUS)
    for name in ("gl_structure", "fl_structure", "el_structure", "ra_structure", "gl_dataset", "edgetb_dataset",
                 "hosts.json", "nodes.json", "links.json"):
        assert name in named


def test_the_unchanged_files_are_accepted(tmp_path):
    """The baseline of the corpus is valid, so each refusal below is due to its one change."""
    for prefix in ALGORITHMS:
        work = tmp_path / prefix
        work.mkdir()
        _prepare(_experiment(work), prefix)
        assert os.path.isfile(work / "dml_file" / "conf" / "n1_structure.json")
    _prepare(_experiment(tmp_path / "gl"), "gl", "edgetb_dataset.json")


@pytest.mark.parametrize("prefix,dataset,change,words", [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_refused_with_the_field_named_and_nothing_written(tmp_path, prefix, dataset, change, words):
    workdir = _experiment(tmp_path, change)
    before = sorted(os.listdir(workdir))
    with pytest.raises(TestbedError) as err:
        _prepare(workdir, prefix, dataset)
    message = err.value.message
    for w in words:
        assert w in message, message
    assert sorted(os.listdir(workdir)) == before  # no dml_file/, no dataset/
    assert not os.path.exists(os.path.join(workdir, "dml_file", "conf"))
    assert not os.path.exists(os.path.join(workdir, "dataset"))


# the mechanism -----------------------------------------------------------------------------------
def test_schema_types_bounds_and_defaults():
    schema = Schema({"n": Field(int, required=True, low=1, high=10), "x": Field(float, default=1.0, low=0, high=1,
                                                                              low_open=True),
                     "tags": Field(list, default=[], max_items=2, items=Field(str))})
    assert schema.validate({"n": 3, "x": 1}, "f.json") == {"n": 3, "x": 1.0, "tags": []}
    assert isinstance(schema.validate({"n": 3, "x": 1}, "f.json")["x"], float)
    for data, words in (({"n": 11}, "f.json: field 'n': must be an integer in [1, 10], got 11"),
                        ({"n": 1.5}, "field 'n': expected an integer"),
                        ({"n": 1, "x": 0}, "field 'x': must be a number in (0, 1], got 0"),
                        ({"n": 1, "x": float("nan")}, "finite"),
                        ({"n": 1, "tags": ["a", 2]}, "field 'tags[1]': expected a string"),
                        ({"n": 1, "tags": ["a"] * 3}, "at most 2"),
                        ({}, "f.json: missing field 'n'"),
                        ({"n": 1, "N": 2}, "field 'N': unknown field; did you mean 'n'?"),
                        ([], "f.json: expected an object, got a list")):
        with pytest.raises(ConfigError) as e:
            schema.validate(data, "f.json")
        assert words in e.value.message, e.value.message
    assert suggestion("zzz", ["epoch"]) == "; valid fields: epoch"


def test_json_problems_are_named(tmp_path):
    (tmp_path / "gl_structure.json").write_text('{"sync": 2, "sync": 3, "node_list": []}')
    with pytest.raises(ConfigError, match="'sync' appears twice"):
        load_structure(str(tmp_path / "gl_structure.json"), load_links(os.path.join(REPO, "links.json")))
    (tmp_path / "d.json").write_text('{"alpha": NaN}')
    with pytest.raises(ConfigError, match="NaN is not a valid number"):
        load_dataset(str(tmp_path / "d.json"))


def test_defaults_fill_the_model():
    confs = load_structure(os.path.join(REPO, "gl_structure.json"), load_links(os.path.join(REPO, "links.json")))
    assert confs["n1"]["model"] == {"kind": "numpy", "hidden": [128], "learning_rate": 0.005, "seed": 0}
    assert confs["n1"]["epoch"] == 3 and confs["n1"]["wait_s"] == 2.0


def test_top_level_epoch_is_the_default_of_entries(tmp_path):
    topo = load_links(os.path.join(REPO, "links.json"))
    (tmp_path / "s.json").write_text(json.dumps({"sync": 3, "epoch": 4, "node_list": [{"name": "n1"},
                                                                                     {"name": "n2", "epoch": 0}]}))
    confs = load_structure(str(tmp_path / "s.json"), topo)
    assert (confs["n1"]["epoch"], confs["n2"]["epoch"]) == (4, 0)
    (tmp_path / "r.json").write_text(json.dumps({"sync": 3, "node_list": [{"name": "n1"}, {"name": "n2"}]}))
    assert load_structure(str(tmp_path / "r.json"), topo, "ring")["n1"]["epoch"] == 1


def test_tls_fingerprint(tmp_path):
    fp = ":".join(["AB"] * 32)
    (tmp_path / "hosts.json").write_text(json.dumps({"hosts": [
        {"name": "local"}, {"name": "e1", "agent": "https://10.0.0.2:3334", "tls_fingerprint": fp}]}))
    hosts = load_hosts(str(tmp_path / "hosts.json"))
    assert hosts.hosts["e1"].tls_fingerprint == "ab" * 32 and hosts.hosts["local"].tls_fingerprint is None
    (tmp_path / "bad.json").write_text(json.dumps({"hosts": [{"name": "e1", "tls_fingerprint": "g" * 64}]}))
    with pytest.raises(TopologyError, match="tls_fingerprint"):
        load_hosts(str(tmp_path / "bad.json"))


def test_link_rates_in_bits_per_second():
    from controller.model.topology import Topology

    t = Topology()
    for n in "abc":
        t.add_node(n)
    t.add_link("a", "b", "10mbps")
    t.add_link("b", "a", "10mbit")
    assert t.rates_text() == "a->b 80 Mbit/s, b->a 10 Mbit/s"
    t.add_link("a", "c", "1gbit")
    assert t.rates_text(limit=2) == "1 at 10 Mbit/s, 1 at 80 Mbit/s, 1 at 1 Gbit/s"


# EdgeTB's per-node dataset format ---------------------------------------------------------------
def test_edgetb_windows_pick_consecutive_one_based_shards(tmp_path):
    from controller.confs.datasets import load_digits

    data = {"a": {"train_len": 2, "train_start_index": 1, "test_len": 1, "test_start_index": 1, "batch_size": 8},
            "b": {"train_len": 3, "train_start_index": 2, "test_len": 2, "test_start_index": 1},
            "_settings": {"shard_size": 50, "batch_size": 20, "global_test_size": 120}}
    (tmp_path / "d.json").write_text(json.dumps(data))
    settings = load_dataset(str(tmp_path / "d.json"))
    assert settings["format"] == "edgetb" and settings["nodes"]["b"]["batch_size"] == 20
    confs = dataset_confs(settings, ["a", "b"], str(tmp_path))
    digits = load_digits()
    with np.load(tmp_path / confs["b"]["shard"]) as b:
        np.testing.assert_array_equal(b["x_train"], digits.x_train[50:200])  # shards 2, 3, 4: overlaps a's
        np.testing.assert_array_equal(b["y_test"], digits.y_test[0:100])
    with np.load(tmp_path / confs["a"]["shard"]) as a:
        np.testing.assert_array_equal(a["x_train"], digits.x_train[0:100])
    assert confs["a"]["batch_size"] == 8 and confs["b"]["batch_size"] == 20
    assert confs["a"]["global_test"] == confs["b"]["global_test"] == "dataset/digits/global_test.npz"
    with np.load(tmp_path / confs["a"]["global_test"], allow_pickle=False) as g:
        assert sorted(g.files) == ["x", "y"]
        np.testing.assert_array_equal(g["x"], digits.x_test[:120])


def test_edgetb_shard_files_used_as_they_are(tmp_path):
    rng = np.random.default_rng(1)
    shards = {}
    for sub, count in (("train_data", 4), ("test_data", 2)):
        d = tmp_path / "dataset" / "FASHION_MNIST" / sub
        d.mkdir(parents=True)
        for i in range(1, count + 1):
            images, labels = rng.integers(0, 256, (7, 28, 28), dtype=np.uint8), rng.integers(0, 10, 7)
            np.save(d / f"images_{i}.npy", images)
            np.save(d / f"labels_{i}.npy", labels)
            shards[(sub, i)] = (images, labels)
    data = {"n1": {"train_len": 2, "train_start_index": 3, "test_len": 1, "test_start_index": 2},
            "_settings": {"dataset": "FASHION_MNIST", "global_test_size": 10}}
    (tmp_path / "d.json").write_text(json.dumps(data))
    confs = dataset_confs(load_dataset(str(tmp_path / "d.json")), ["n1"], str(tmp_path))
    with np.load(tmp_path / confs["n1"]["shard"]) as s:
        want = np.concatenate([shards[("train_data", 3)][0], shards[("train_data", 4)][0]])[..., None] / 255.0
        assert s["x_train"].shape == (14, 28, 28, 1) and s["x_train"].dtype == np.uint8  # stored as the bytes
        np.testing.assert_allclose(unpack(s["x_train"]), want, rtol=1e-6)
        np.testing.assert_array_equal(s["y_test"], shards[("test_data", 2)][1])
    with np.load(tmp_path / confs["n1"]["global_test"]) as g:  # the test shards, capped at 10 samples
        np.testing.assert_array_equal(g["y"], np.concatenate([shards[("test_data", 1)][1],
                                                              shards[("test_data", 2)][1]])[:10])


def test_settings_format_global_test_is_the_held_out_split(tmp_path):
    (tmp_path / "d.json").write_text(json.dumps({"dataset": "digits", "global_test_size": 1000}))
    confs = dataset_confs(load_dataset(str(tmp_path / "d.json")), ["a", "b"], str(tmp_path))
    from controller.confs.datasets import load_digits

    with np.load(tmp_path / confs["b"]["global_test"], allow_pickle=False) as g:
        assert len(g["y"]) == 359  # the whole test split: smaller than the cap
        np.testing.assert_array_equal(g["y"], load_digits().y_test)


# the conf generators under a plain python3 ----------------------------------------------------
PLAIN_PYTHON = next((p for p in ("/usr/bin/python3", shutil.which("python3")) if p and os.path.exists(p)), None)


@pytest.mark.skipif(PLAIN_PYTHON is None, reason="no python3 outside the virtualenv")
def test_conf_generators_run_under_plain_python3(tmp_path):
    for name in ("links.json", "fl_structure.json", "fl_dataset.json", "gl_structure.json", "gl_dataset.json",
                 "el_structure.json"):
        shutil.copy(os.path.join(REPO, name), tmp_path / name)
    env = {"PATH": "/usr/bin:/bin"}
    for cmd in (["dml_tool/dataset_conf.py", "-d", "gl_dataset.json"],
                ["dml_tool/dataset_conf.py", "-s", "fl_structure.json"],
                ["dml_tool/fl_structure_conf.py", "-s", "fl_structure.json"]):
        out = subprocess.run([PLAIN_PYTHON, os.path.join(REPO, cmd[0]), *cmd[1:]], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (cmd, out.stderr)
        assert "dml_file/conf/n2_" in out.stdout
    with open(tmp_path / "dml_file" / "conf" / "n2_dataset.json") as f:
        assert json.load(f)["global_test"] == "dataset/digits/global_test.npz"
    bad = subprocess.run([PLAIN_PYTHON, os.path.join(REPO, "dml_tool/dataset_conf.py"), "-s", "el_structure.json"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "el_dataset.json: cannot read" in bad.stderr
