"""The PyTorch Flower example (examples/flower/torch_app) over the emulated network: 2 SuperNodes
and 2 rounds on shaped links, each on its own digits shard, the model sent as its state_dict;
per-round rows in metrics.csv, the accuracy rising, nothing left after the run. A Flower Python
without torch is refused before anything is made."""
from __future__ import annotations

import csv
import gzip
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from controller.flower.structure import installed
from tests.e2e.harness import ROOT
from tests.e2e.test_flower import FLWR_PYTHON, HAVE_FLWR, REQUIRED, flwr_argv, processes_of, run_folder

HAVE_TORCH = "torch" in installed(FLWR_PYTHON)
TORCH_REQUIRED = REQUIRED and os.environ.get("EDGETB_FLWR_TORCH", "1") != "0"  # scripts/test.sh installs it
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)"),
              pytest.mark.skipif(not HAVE_FLWR and not REQUIRED,
                                 reason=f"flwr not installed in {FLWR_PYTHON} (bash scripts/flower_setup.sh)")]
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH and not TORCH_REQUIRED,
    reason=f"torch not installed in {FLWR_PYTHON} (EDGETB_FLWR_TORCH=1 bash scripts/flower_setup.sh)")
SUPERNODES = {"n2": "20mbit", "n3": "10mbit"}
HIDDEN = 32
MODEL_BYTES = (64 * HIDDEN + HIDDEN + HIDDEN * 10 + 10) * 4  # the MLP's state_dict as float32


def experiment(tmp_path: Path, python: str = FLWR_PYTHON) -> Path:
    workdir = tmp_path / "exp"
    workdir.mkdir()
    os.chmod(workdir, 0o755)  # (the nodes read it as their own users)
    shutil.copytree(ROOT / "examples" / "flower" / "torch_app", workdir / "torch_app")
    links = {"n1": [{"dest": n, "bw": bw} for n, bw in SUPERNODES.items()],
             **{n: [{"dest": "n1", "bw": bw}] for n, bw in SUPERNODES.items()}}
    (workdir / "links.json").write_text(json.dumps(links))
    (workdir / "flwr_dataset.json").write_text(json.dumps({"dataset": "digits", "split": "iid", "seed": 0,
                                                           "batch_size": 32}))
    (workdir / "flwr_structure.json").write_text(json.dumps({
        "app": "torch_app", "python": python, "superlink": "n1", "node_list": ["n1", *SUPERNODES],
        "run_config": {"num-server-rounds": 2, "hidden-units": HIDDEN}}))
    return workdir


@needs_torch
def test_the_torch_app_learns_over_two_rounds_on_shaped_links_and_leaves_nothing(tmp_path):
    workdir = experiment(tmp_path)
    argv, env = flwr_argv(workdir, "-d", "flwr_dataset.json", "--auto")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Flower round 2/2" in done.stdout and "2 SuperNodes registered" in done.stdout, done.stdout
    out = run_folder(workdir)
    record = json.loads((out / "run.json").read_text())
    assert record["ended"] == "completed" and record["algorithm"] == "flower", record
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["round"], r["node"]) for r in rows] == [("1", "n1"), ("2", "n1")]
    acc = [float(r["flwr_eval_acc"]) for r in rows]
    assert all(float(r["flwr_eval_loss"]) > 0.0 and float(r["flwr_train_loss"]) > 0.0 for r in rows), rows
    assert 0.0 <= acc[0] < acc[1] <= 1.0 and acc[1] > 0.5, acc  # it learns
    assert float(rows[1]["flwr_eval_loss"]) < float(rows[0]["flwr_eval_loss"]), rows
    assert "final model: " in (out / "flower" / "n1-run.log").read_text()
    for n in SUPERNODES:  # trained on its own shard, given by its node config
        assert "Received successfully" in (out / "flower" / f"{n}-supernode.log").read_text()
    with gzip.open(out / "telemetry" / "links.csv.gz", "rt") as f:
        sent: dict[tuple[str, str], int] = {}
        for r in csv.DictReader(f):
            sent[(r["src"], r["dst"])] = max(sent.get((r["src"], r["dst"]), 0), int(r["tx_bytes"]))
    for n in SUPERNODES:  # the state_dict went out (train + evaluate) and came back, 2 rounds
        assert sent[("n1", n)] > 2 * 2 * MODEL_BYTES, sent
        assert sent[(n, "n1")] > 2 * MODEL_BYTES, sent
    uids = set(record["flower"]["uids"].values())
    assert len(uids) == 3 and processes_of(uids) == []
    assert not any(Path("/run/edgetb-flwr", str(uid)).exists() for uid in uids)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "etb-" + record["testbed_id"] + "-" not in left


def fake_flower_python(where: Path) -> Path:
    """A Python environment with Flower's commands and numpy but no torch (nothing of it runs:
    the checks read its bin/ and its dist-info names)."""
    for c in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr"):
        (where / "bin").mkdir(parents=True, exist_ok=True)
        (where / "bin" / c).write_text("#!/bin/sh\nexit 1\n")
        (where / "bin" / c).chmod(0o755)
    site = where / "lib" / "python3.11" / "site-packages"
    for dist in ("flwr-1.42.0", "numpy-2.4.6"):
        (site / f"{dist}.dist-info").mkdir(parents=True)
    return where


def test_the_torch_app_on_a_flower_python_without_torch_is_refused_before_anything_is_made(tmp_path):
    python = fake_flower_python(tmp_path / "flwr-no-torch")
    workdir = experiment(tmp_path, python=str(python))
    argv, env = flwr_argv(workdir, "-d", "flwr_dataset.json", "--auto")
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"needs 'torch>=2.4', but in {python} it is not installed" in done.stderr, done.stderr
    assert f"EDGETB_FLWR_PYTHON={python} EDGETB_FLWR_TORCH=1 bash scripts/flower_setup.sh" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "creating" not in done.stdout
    assert not (workdir / "dml_file" / "log").exists() or not any((workdir / "dml_file" / "log").iterdir())
