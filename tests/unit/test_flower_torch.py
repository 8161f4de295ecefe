"""The PyTorch Flower example's dependency checked before a run: a Flower Python without torch
is refused naming the setup script that installs PyTorch's CPU build (pinned as the script pins it)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from controller.flower.structure import TORCH_VERSION, load
from controller.model.topology import Topology
from worker.api.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "flower" / "torch_app"


def _experiment(tmp_path: Path, dists: tuple[str, ...]) -> tuple[str, str, Path]:
    """The torch example in an experiment directory; a Flower Python holding ``dists``."""
    shutil.copytree(APP, tmp_path / "torch_app")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for c in ("flower-superlink", "flower-supernode", "flower-superexec", "flwr"):
        (venv / "bin" / c).write_text("#!/bin/sh\n")
        (venv / "bin" / c).chmod(0o755)
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    for dist in dists:
        (site / f"{dist}.dist-info").mkdir()
    path = tmp_path / "flwr_structure.json"
    path.write_text(json.dumps({"app": "torch_app", "python": str(venv), "node_list": ["n1", "n2", "n3"]}))
    return str(path), str(tmp_path), site


def _topology() -> Topology:
    t = Topology()
    for n in ("n1", "n2", "n3"):
        t.add_node(n)
    return t


def test_the_torch_example_needs_torch_and_the_error_names_the_pinned_setup(tmp_path):
    path, workdir, site = _experiment(tmp_path, ("flwr-1.42.0", "numpy-2.4.6"))
    with pytest.raises(ConfigError) as e:
        load(path, _topology(), workdir)
    message = e.value.message
    assert "needs 'torch>=2.4', but in" in message and "it is not installed" in message, message
    assert f"EDGETB_FLWR_PYTHON={tmp_path / 'venv'} EDGETB_FLWR_TORCH=1 bash scripts/flower_setup.sh" in message
    assert f"torch=={TORCH_VERSION}" in message
    (site / f"torch-{TORCH_VERSION}+cpu.dist-info").mkdir()
    assert load(path, _topology(), workdir).app_name == "torch-app"


def test_a_torch_the_setup_does_not_give_gets_pip_s_hint(tmp_path):
    path, workdir, _ = _experiment(tmp_path, ("flwr-1.42.0", "numpy-2.4.6"))
    project = tmp_path / "torch_app" / "pyproject.toml"
    project.write_text(project.read_text().replace('"torch>=2.4"', '"torch>=9"'))
    with pytest.raises(ConfigError, match=r"needs 'torch>=9', .* install it with '.*/venv/bin/pip install \"torch>=9\"'"):
        load(path, _topology(), workdir)


def test_the_setup_script_pins_the_torch_the_checks_name():
    script = (ROOT / "scripts" / "flower_setup.sh").read_text()
    assert re.search(r"TORCH_SPEC:-torch==" + re.escape(TORCH_VERSION) + r"\}", script)
    assert re.search(r'EDGETB_FLWR_TORCH=\$\{EDGETB_FLWR_TORCH:-1\} bash scripts/flower_setup.sh',
                     (ROOT / "scripts" / "test.sh").read_text())


def test_the_flower_programs_of_a_torch_app_ask_the_fork_server_to_preload_torch(tmp_path):
    from controller.flower import plan
    from controller.flower.structure import FlowerStructure
    from worker.api.protocol import PRELOAD_ENV

    shutil.copytree(APP, tmp_path / "torch_app")
    shutil.copytree(ROOT / "examples" / "flower" / "numpy_app", tmp_path / "numpy_app")
    ips = {"n1": "10.0.0.2", "n2": "10.0.0.3"}
    for app, preload in (("torch_app", "torch"), ("numpy_app", None)):
        s = FlowerStructure(str(tmp_path / app), "/opt/venv", "n1", ("n2",))
        programs = plan.servers(s, str(tmp_path), "r1", ips)
        assert [p.env.get(PRELOAD_ENV) for p in programs] == [preload] * 3, programs
        assert all(p.env["EDGETB_FORK"] == "flower" for p in programs)


def test_the_fork_server_preloads_and_warms_torch_on_one_thread_leaving_its_generator_as_it_was():
    pytest.importorskip("torch")
    import subprocess
    import sys

    code = ("import os, sys, torch\n"
            "before = torch.random.get_rng_state()\n"
            "from worker.confinement.flower_forks import _preload\n"
            "assert _preload({}, ('torch',)) == {}\n"
            "assert len(os.listdir('/proc/self/task')) == 1, os.listdir('/proc/self/task')\n"
            "assert torch.equal(before, torch.random.get_rng_state())\n"
            "assert 'torch.optim.sgd' in sys.modules and 'numpy' in sys.modules\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
