"""EdgeTB's per-node dataset format end to end: gl_run.py on netns nodes, with EdgeTB's own
shard files (``train_data/images_<i>.npy`` ...) and windows of consecutive 1-based shards."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from controller.confs.datasets import load_digits
from dml_app.models.samples import unpack
from dml_app.runtime.events import read_events
from tests.e2e.harness import Run

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
NODES = ["n1", "n2", "n3", "n4"]
SHARD = 90  # samples per shard file
LINKS = {a: [{"dest": NODES[(i + 1) % 4], "bw": "20mbit"}, {"dest": NODES[(i - 1) % 4], "bw": "20mbit"}]
         for i, a in enumerate(NODES)}
STRUCTURE = {"sync": 4, "wait_s": 1, "model": {"kind": "numpy", "hidden": [64], "learning_rate": 0.005, "seed": 0},
             "node_list": [{"name": n, "epoch": 2} for n in NODES]}
# windows overlap (n2 and n3 share shard 5), batch sizes differ per node
WINDOWS = {"n1": (1, 3, 1, 1, 16), "n2": (4, 2, 1, 1, 32), "n3": (5, 3, 2, 1, 8), "n4": (8, 4, 1, 2, 64)}
DATASET = {n: {"train_start_index": a, "train_len": b, "test_start_index": c, "test_len": d, "batch_size": e}
           for n, (a, b, c, d, e) in WINDOWS.items()}
DATASET["_settings"] = {"dataset": "EDGE_DIGITS", "global_test_size": 150}


def _write_shard_files(workdir: Path) -> None:
    """Digits in EdgeTB's layout: 8x8 images as uint8 pixels, integer labels, SHARD samples per file."""
    digits = load_digits()
    for sub, x, y in (("train_data", digits.x_train, digits.y_train), ("test_data", digits.x_test, digits.y_test)):
        d = workdir / "dataset" / "EDGE_DIGITS" / sub
        d.mkdir(parents=True)
        for i in range(len(x) // SHARD):
            part = slice(i * SHARD, (i + 1) * SHARD)
            np.save(d / f"images_{i + 1}.npy", np.round(x[part] * 255).astype(np.uint8).reshape(-1, 8, 8))
            np.save(d / f"labels_{i + 1}.npy", y[part])


def test_gossip_on_edgetb_shard_files(run):
    r: Run = run(structure=STRUCTURE, links=LINKS, dataset=DATASET, defer=True)
    _write_shard_files(r.workdir)
    r.start("--auto", "--timeout", "300")
    assert r.proc.wait(timeout=360) == 0, r.close()
    out = r.close()
    conf_dir = r.workdir / "dml_file" / "conf"
    confs = {n: json.loads((conf_dir / f"{n}_dataset.json").read_text()) for n in NODES}
    for n, (start, length, t_start, t_len, batch) in WINDOWS.items():
        assert confs[n]["batch_size"] == batch and confs[n]["train_samples"] == length * SHARD
        assert confs[n]["global_test"] == "dataset/EDGE_DIGITS/global_test.npz"
        with np.load(r.workdir / confs[n]["shard"], allow_pickle=False) as s:
            first = np.load(r.workdir / "dataset/EDGE_DIGITS/train_data" / f"images_{start}.npy")
            assert s["x_train"].dtype == np.uint8  # stored as the bytes they came as
            np.testing.assert_allclose(unpack(s["x_train"][:SHARD]), first[..., None] / 255.0, rtol=1e-6)
            assert len(s["y_test"]) == t_len * SHARD
    with np.load(r.workdir / "dataset/EDGE_DIGITS/global_test.npz", allow_pickle=False) as g:
        assert g["x"].shape == (150, 8, 8, 1) and sorted(g.files) == ["x", "y"]
    run_dirs = sorted(d for d in (r.workdir / "dml_file" / "log").iterdir() if (d / "events").is_dir())
    assert run_dirs, f"no run folder:\n{out}"
    events_dir = run_dirs[-1] / "events"
    for n, (start, length, t_start, t_len, batch) in WINDOWS.items():
        events = read_events(str(events_dir / f"{n}.jsonl"))
        started = next(e for e in events if e["type"] == "started")
        assert started["train_samples"] == length * SHARD and started["test_samples"] == t_len * SHARD
        rounds = [e for e in events if e["type"] == "round"]
        assert len(rounds) == STRUCTURE["sync"], (n, rounds)
        assert rounds[-1]["accuracy"] >= 0.6, (n, rounds[-1])


def test_a_typo_in_an_edgetb_entry_stops_the_run_before_anything_is_made(run):
    bad = json.loads(json.dumps(DATASET))
    bad["n2"]["trian_len"] = bad["n2"].pop("train_len")
    r: Run = run(structure=STRUCTURE, links=LINKS, dataset=bad, defer=True)
    _write_shard_files(r.workdir)
    r.start("--auto")
    assert r.proc.wait(timeout=120) == 2
    out = r.close()
    assert "gl_dataset.json: node 'n2', field 'trian_len': unknown field; did you mean 'train_len'?" in out, out
    assert not (r.workdir / "dml_file").exists()
    assert sorted(p.name for p in (r.workdir / "dataset" / "EDGE_DIGITS").iterdir()) == ["test_data", "train_data"]
