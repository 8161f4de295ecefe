"""Flower runs, the pure parts: flwr_structure.json checked, the Flower processes planned,
Flower 1.42's log of a run read into metrics.csv rows."""
from __future__ import annotations

import json
import os

import pytest

from controller.flower import metrics, plan
from controller.flower.structure import FlowerStructure, load, node_pythons
from controller.model.topology import Topology
from worker.api.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "data")
APP_TOML = """[project]
name = "tiny-app"
version = "1.0.0"
[tool.flwr.app]
publisher = "edgetb"
[tool.flwr.app.components]
serverapp = "tiny.server:app"
clientapp = "tiny.client:app"
"""


def _topology(names=("n1", "n2", "n3")) -> Topology:
    t = Topology()
    for n in names:
        t.add_node(n)
    return t


def _python(tmp_path, commands=("flower-superlink", "flower-supernode", "flower-superexec", "flwr")) -> str:
    env = tmp_path / "venv"
    (env / "bin").mkdir(parents=True)
    for c in commands:
        (env / "bin" / c).write_text("#!/bin/sh\n")
        (env / "bin" / c).chmod(0o755)
    return str(env)


def _experiment(tmp_path, **fields) -> tuple[str, str]:
    app = tmp_path / "app"
    app.mkdir(exist_ok=True)
    (app / "pyproject.toml").write_text(APP_TOML)
    doc = {"app": "app", "python": _python(tmp_path) if not (tmp_path / "venv").exists() else str(tmp_path / "venv"),
           "node_list": ["n1", "n2", "n3"], **fields}
    path = tmp_path / "flwr_structure.json"
    path.write_text(json.dumps(doc))
    return str(path), str(tmp_path)


def test_a_structure_resolves_the_superlink_the_supernodes_and_the_app(tmp_path):
    path, workdir = _experiment(tmp_path, node_config={"n3": {"local-epochs": 3}}, run_config={"lr": 0.1})
    s = load(path, _topology(), workdir)
    assert (s.superlink, s.supernodes, s.app_name) == ("n1", ("n2", "n3"), "tiny-app")
    assert s.app == str(tmp_path / "app") and s.node_config == {"n3": {"local-epochs": 3}}
    path, _ = _experiment(tmp_path, superlink="n2")
    assert load(path, _topology(), workdir).supernodes == ("n1", "n3")


@pytest.mark.parametrize("fields, message", [
    ({"app": "nothing"}, "no app directory"),
    ({"app": "/etc"}, "relative to the experiment directory"),
    ({"app": "../.."}, "outside the experiment directory"),
    ({"node_list": ["n1"]}, "at least two node names"),
    ({"node_list": ["n1", "n9"]}, "'n9', which is not a node of the links file"),
    ({"node_list": ["n1", "n2", "n2"]}, "names a node twice"),
    ({"superlink": "n9"}, "field 'superlink' must be a node of node_list"),
    ({"node_config": {"n1": {"a": 1}}}, "'n1', which is not a SuperNode"),
    ({"node_config": {"n2": {"bad key": 1}}}, "node_config.n2: key 'bad key'"),
    ({"run_config": {"k": [1, 2]}}, "run_config.k: must be a string, number or boolean"),
    ({"python": "venv"}, "absolute path of a virtual environment"),
    ({"rounds": 3}, "unknown field 'rounds'"),
])
def test_bad_structures_are_refused_naming_the_field(tmp_path, fields, message):
    path, workdir = _experiment(tmp_path, **fields)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        load(path, _topology(), workdir)
    assert path in e.value.message or "pyproject" in e.value.message


def test_an_app_without_tool_flwr_app_or_a_python_without_flwr_is_refused(tmp_path):
    path, workdir = _experiment(tmp_path)
    (tmp_path / "app" / "pyproject.toml").write_text('[project]\nname = "x"\n')
    with pytest.raises(ConfigError, match=r"no \[tool.flwr.app\] table: not a Flower app"):
        load(path, _topology(), workdir)
    (tmp_path / "app" / "pyproject.toml").write_text(APP_TOML)
    (tmp_path / "venv" / "bin" / "flower-superexec").unlink()
    with pytest.raises(ConfigError, match=r"flwr is not installed in .*venv \(no flower-superexec in its bin/\)"):
        load(path, _topology(), workdir)


def test_a_run_config_key_the_app_does_not_have_is_refused_naming_it(tmp_path):
    path, workdir = _experiment(tmp_path, run_config={"num-server-round": 2})
    with open(tmp_path / "app" / "pyproject.toml", "a") as f:
        f.write('[tool.flwr.app.config]\nnum-server-rounds = 3\nlr = 0.1\n[tool.flwr.app.config.opt]\nm = 0.9\n')
    with pytest.raises(ConfigError, match=r"run_config: 'num-server-round' is not a key of the app's "
                                          r"\[tool.flwr.app.config\] \(did you mean 'num-server-rounds'\?"):
        load(path, _topology(), workdir)
    path, _ = _experiment(tmp_path, run_config={"num-server-rounds": 2, "lr": 0.5})
    with open(tmp_path / "app" / "pyproject.toml", "a") as f:
        f.write('[tool.flwr.app.config]\nnum-server-rounds = 3\nlr = 0.1\n')
    assert load(path, _topology(), workdir).run_config == {"num-server-rounds": 2, "lr": 0.5}


def test_an_app_with_flower_s_federations_table_is_refused_saying_what_to_do(tmp_path):
    path, workdir = _experiment(tmp_path)
    with open(tmp_path / "app" / "pyproject.toml", "a") as f:
        f.write('[tool.flwr.federations]\ndefault = "local"\n')
    with pytest.raises(ConfigError, match=r"delete or comment out its \[tool.flwr.federations\] table"):
        load(path, _topology(), workdir)


def test_the_app_s_declared_dependencies_must_be_installed_in_its_python(tmp_path):
    path, workdir = _experiment(tmp_path)
    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    (site / "scikit_learn-1.9.1.dist-info").mkdir(parents=True)
    (site / "numpy-2.4.6.dist-info").mkdir()
    project = tmp_path / "app" / "pyproject.toml"

    def declare(*deps: str) -> None:
        project.write_text(APP_TOML.replace('version = "1.0.0"', f'version = "1.0.0"\ndependencies = {list(deps)!r}'))

    declare("numpy>=1.26", "scikit-learn", "windows-only; sys_platform == 'win32'")
    load(path, _topology(), workdir)
    declare("numpy>=3")
    with pytest.raises(ConfigError, match=r"needs 'numpy>=3', but in .*venv 2.4.6 is installed: install it"):
        load(path, _topology(), workdir)
    declare("torch")
    with pytest.raises(ConfigError, match=r"field 'python': the app .* needs 'torch', but in .* it is not installed"):
        load(path, _topology(), workdir)
    declare("not a requirement!")
    with pytest.raises(ConfigError, match="dependency 'not a requirement!' cannot be read"):
        load(path, _topology(), workdir)


def test_the_structure_s_python_becomes_each_flower_node_s_unless_the_nodes_file_declares_one(tmp_path):
    path, workdir = _experiment(tmp_path)
    topology = _topology(("n1", "n2", "n3", "n4"))
    other = _python(tmp_path / "other")
    topology.nodes["n3"].python = other
    chosen = node_pythons(load(path, topology, workdir), topology)
    assert chosen == {"n1": str(tmp_path / "venv"), "n2": str(tmp_path / "venv"), "n3": other}
    assert topology.nodes["n4"].python is None  # not a Flower node
    (tmp_path / "other" / "venv" / "bin" / "flwr").unlink()
    topology.nodes["n3"].python = other
    with pytest.raises(ConfigError, match="node 'n3': python: flwr is not installed"):
        node_pythons(load(path, topology, workdir), topology)


def _structure(**kw) -> FlowerStructure:
    return FlowerStructure(**{"app": "/x/app", "python": "/opt/f", "superlink": "n1", "supernodes": ("n2", "n3"),
                              **kw})


def test_the_plan_puts_homes_in_node_directories_and_runs_supernodes_with_process_isolation():
    ips = {"n1": "10.1.0.2", "n2": "10.1.0.3", "n3": "10.1.0.4"}
    progs = plan.servers(_structure(node_config={"n3": {"num-partitions": 5, "name": 'a "b"'}}), "/w", "r1", ips,
                         {"n2": "/w/dataset/digits/n2.npz"})
    assert [(p.node, p.name) for p in progs] == [("n1", "superlink"), ("n2", "supernode"), ("n2", "superexec"),
                                                 ("n3", "supernode"), ("n3", "superexec")]
    sl = progs[0]
    assert sl.env == {"FLWR_HOME": "/w/dml_file/node/n1/flwr_home-r1", "FLWR_TELEMETRY_ENABLED": "0",
                      "EDGETB_FORK": "flower", "EDGETB_CPU_WEIGHT": "800"}  # (its node outweighs the others)
    assert all("EDGETB_CPU_WEIGHT" not in p.env for p in progs[1:])
    unweighed = plan.servers(_structure(), "/w", "r1", ips, superlink_cpu_weight=100)[0]
    assert "EDGETB_CPU_WEIGHT" not in unweighed.env
    assert all(p.env["FLWR_TELEMETRY_ENABLED"] == "0" for p in progs)  # (flwr's exit waits 4 s to send it)
    assert all(p.env["EDGETB_FORK"] == "flower" for p in progs)  # forked from the Flower fork server
    assert "--disable-runtime-dependency-installation" in sl.argv
    assert sl.argv[sl.argv.index("--database") + 1] == "/w/dml_file/node/n1/flwr_home-r1/superlink.db"
    assert sl.argv[sl.argv.index("--host") + 1] == "10.1.0.2"
    n2, n3 = progs[1].argv, progs[3].argv
    assert n2[n2.index("--isolation") + 1] == "process" and n2[n2.index("--superlink") + 1] == "10.1.0.2:9092"
    assert n2[n2.index("--node-config") + 1] == 'data-path="/w/dataset/digits/n2.npz" num-partitions=2 partition-id=0'
    assert n3[n3.index("--node-config") + 1] == 'name="a \\"b\\"" num-partitions=5 partition-id=1'
    assert progs[2].argv[-1] == f"127.0.0.1:{plan.CLIENTAPP_PORT}"


def test_the_superlink_keeps_its_state_in_memory_above_a_few_supernodes():
    many = _structure(supernodes=tuple(f"n{i}" for i in range(2, plan.FILE_STATE_MAX_SUPERNODES + 3)))
    ips = {n: "10.1.0.2" for n in ("n1", *many.supernodes)}
    sl = plan.servers(many, "/w", "r1", ips)[0]
    assert sl.argv[sl.argv.index("--database") + 1] == plan.IN_MEMORY == ":flwr-in-memory:"
    assert plan.database(many, "/w", "r1") is None
    assert plan.database(_structure(), "/w", "r1") == "/w/dml_file/node/n1/flwr_home-r1/superlink.db"


def test_the_app_is_submitted_with_flower_s_cli_and_its_config_names_the_superlink():
    run = plan.submit(_structure(run_config={"num-server-rounds": 3, "fast": True}), "/w", "r1")
    assert run.argv == ("flwr", "run", "/x/app", plan.CONNECTION, "--stream", "--run-config",
                        "fast=true num-server-rounds=3")
    assert run.env["FLWR_HOME"] == "/w/dml_file/node/n1/flwr_home-r1"
    assert 'address = "10.1.0.2:9092"\ninsecure = true' in plan.cli_config("10.1.0.2")


def test_flower_1_42_s_log_of_a_run_gives_one_row_a_round():
    with open(os.path.join(DATA, "flower_1.42_run.log"), encoding="utf-8") as f:
        reader = metrics.RoundReader().feed_all(f.read().split("\n"))
    assert reader.num_rounds == 2 and sorted(reader.rounds) == [1, 2] and reader.finished  # (its summary line)
    assert not metrics.RoundReader().feed_all(["INFO :      [ROUND 2/2]"]).finished
    columns, rows = metrics.rows(reader, "r1", "n1")
    assert columns == ["run_id", "algorithm", "node", "round", "time_s", "flwr_eval_acc", "flwr_eval_loss",
                       "flwr_train_loss"]
    assert [(r["round"], r["node"], r["algorithm"]) for r in rows] == [(1, "n1", "flower"), (2, "n1", "flower")]
    assert rows[1]["flwr_train_loss"] < rows[0]["flwr_train_loss"]
    assert 0.0 <= rows[1]["flwr_eval_acc"] <= 1.0


def test_failed_replies_are_counted_and_a_run_whose_clientapps_all_failed_is_told():
    with open(os.path.join(DATA, "flower_1.42_run.log"), encoding="utf-8") as f:
        lines = f.read().split("\n")
    reader = metrics.RoundReader().feed_all(lines)
    assert reader.replies[1] == {"train": (2, 0), "evaluate": (2, 0)} and reader.failed(1) == 0
    assert not reader.nothing_trained()
    broken = [line.replace("Received 2 results and 0 failures", "Received 0 results and 2 failures") for line in lines]
    reader = metrics.RoundReader().feed_all(broken)
    assert reader.failed(2) == 4 and reader.nothing_trained()
    assert not metrics.RoundReader().nothing_trained()  # (no round: nothing to tell)


def test_a_name_reported_by_two_sections_is_told_apart_and_the_server_s_records_are_read():
    lines = ["INFO :      [ROUND 1/1]", "INFO :      aggregate_train: Received 2 results and 0 failures",
             "INFO :      \t└──> Aggregated MetricRecord: {'loss': 0.5, 'n': 3}",
             "INFO :      aggregate_evaluate: Received 2 results and 0 failures",
             "INFO :      \t└──> Aggregated MetricRecord: {'loss': 0.25, 'acc': 0.75, 'bad': nan}",
             "INFO :      Global evaluation", "INFO :      \t└──> MetricRecord: {'central_acc': 0.8}"]
    columns, rows = metrics.rows(metrics.RoundReader().feed_all(lines), "r", "n1")
    assert columns[5:] == ["flwr_acc", "flwr_central_acc", "flwr_evaluate_loss", "flwr_n", "flwr_train_loss"]
    assert rows[0]["flwr_train_loss"] == 0.5 and rows[0]["flwr_evaluate_loss"] == 0.25
    assert rows[0]["flwr_central_acc"] == 0.8 and "flwr_bad" not in columns


def test_a_record_outside_a_round_or_that_cannot_be_read_adds_nothing():
    lines = ["\x1b[92mINFO \x1b[0m: Aggregated MetricRecord: {'a': 1}", "[ROUND 1/2]", "aggregate_train: x",
             "Aggregated MetricRecord: {__import__('os')}"]
    reader = metrics.RoundReader().feed_all(lines)
    assert reader.rounds == {1: {"train": {}}}
    assert metrics.rows(reader, "r", "n")[0] == metrics.BASE_COLUMNS


def test_edgetb_predict_refuses_a_flower_run_folder(tmp_path):
    from controller.predict.setting import from_run_dir

    (tmp_path / "run.json").write_text(json.dumps({"algorithm": "flower"}))
    with pytest.raises(ConfigError, match="a Flower run .flwr_run.py.: its learning is the app's own"):
        from_run_dir(str(tmp_path))


def _loader(tmp_path, script: str) -> None:
    """The fake environment's python3: ``script`` (sh) stands for flwr's loader."""
    python3 = tmp_path / "venv" / "bin" / "python3"
    python3.write_text("#!/bin/sh\n" + script)
    python3.chmod(0o755)


def test_the_app_is_loaded_by_its_python_before_the_run_and_a_failure_is_said(tmp_path, monkeypatch):
    from controller.flower import probe

    monkeypatch.setattr(probe.os, "geteuid", lambda: 1000)  # unconfined: the sandbox's own test is e2e
    _experiment(tmp_path)
    assert probe.components(str(tmp_path / "app")) == ["tiny.server:app", "tiny.client:app"]
    _loader(tmp_path, 'test "$4" = tiny.server:app && test "$5" = tiny.client:app\n')
    probe.check_loads(str(tmp_path / "app"), str(tmp_path / "venv"))
    _loader(tmp_path, "echo 'ModuleNotFoundError: No module named tiny' >&2; exit 1\n")
    with pytest.raises(ConfigError, match="does not load .*No module named tiny"):
        probe.check_loads(str(tmp_path / "app"), str(tmp_path / "venv"))
    _loader(tmp_path, "sleep 5\n")
    with pytest.raises(ConfigError, match="took over 0.5 s"):
        probe.check_loads(str(tmp_path / "app"), str(tmp_path / "venv"), timeout_s=0.5)


def test_the_dashboard_s_accuracy_and_loss_are_picked_from_flower_s_metric_names():
    from controller.flower.session import ACCURACY_KEYS, LOSS_KEYS, pick

    values = {"train_loss": 2.0, "eval_loss": 1.5, "eval_acc": 0.8}
    assert pick(values, ACCURACY_KEYS) == 0.8 and pick(values, LOSS_KEYS) == 1.5
    assert pick({"train_loss": 2.0}, ACCURACY_KEYS) is None


def test_check_validates_a_flower_experiment_and_makes_nothing(tmp_path, capsys, monkeypatch):
    from controller.flower import probe
    from controller.model.spec import RunOptions
    from controller.runner import run

    monkeypatch.setattr(probe, "check_loads", lambda app, python: None)  # (a fake environment: nothing to load)

    path, workdir = _experiment(tmp_path)
    (tmp_path / "links.json").write_text(json.dumps({"n1": [{"dest": "n2", "bw": "10mbit"}],
                                                     "n2": [{"dest": "n1", "bw": "10mbit"}], "n3": []}))
    options = RunOptions(algorithm="flower", workdir=workdir, structure="flwr_structure.json", dataset="", check=True)
    assert run(options) == 0
    out = capsys.readouterr().out
    assert "check passed" in out and "app tiny-app, SuperLink n1, 2 SuperNodes, 2 links" in out
    assert not (tmp_path / "dml_file" / "log").exists()
    (tmp_path / "app" / "pyproject.toml").unlink()
    assert run(options) == 2
    assert "pyproject.toml does not exist" in capsys.readouterr().err


def test_round_times_are_flower_s_own_the_superlink_s_stored_log_pieces():
    """Flower 1.42's ``task_logs`` of a 3-round run (the SuperLink stores the ServerApp's log in
    pieces, each with its time): a round is timed by the piece holding its first record."""
    with open(os.path.join(DATA, "flower_1.42_task_logs.json"), encoding="utf-8") as f:
        pieces = [(t, text) for t, text in json.load(f)]
    started_at = pieces[0][0] - 2.0
    times = metrics.times_from_pieces(reversed(pieces), started_at)  # (the order they come in does not matter)
    assert sorted(times) == [1, 2, 3]
    assert [round(times[r], 3) for r in (1, 2, 3)] == [round(pieces[i][0] - started_at, 3) for i in (2, 3, 4)]
    assert times[1] < times[2] < times[3]
    assert metrics.times_from_pieces([], started_at) == {}


def test_the_superlink_s_cpu_weight_is_checked_before_anything_starts():
    from controller.flower import plan

    assert plan.superlink_cpu_weight({}) == plan.SUPERLINK_CPU_WEIGHT
    assert plan.superlink_cpu_weight({plan.SUPERLINK_CPU_WEIGHT_ENV: "250"}) == 250
    for bad in ("0", "10001", "eight", "-5", "1.5"):
        with pytest.raises(ConfigError, match="EDGETB_FLWR_SUPERLINK_CPU_WEIGHT"):
            plan.superlink_cpu_weight({plan.SUPERLINK_CPU_WEIGHT_ENV: bad})


def test_an_ended_flwr_run_s_exit_code_is_asked_again_while_the_worker_does_not_know_it(monkeypatch):
    from controller.flower import flow

    class Worker:
        def __init__(self, codes):
            self.codes = list(codes)

        def processes(self):
            code = self.codes.pop(0) if len(self.codes) > 1 else self.codes[0]
            return {"processes": [{"id": "p1", "node": "n1", "running": False, "returncode": code}]}

    monkeypatch.setattr(flow, "POLL_S", 0.01)
    run = flow.FlowerRun.__new__(flow.FlowerRun)  # (only its worker is read)
    run.worker = Worker([None, None, 0])
    assert run._exit_code({"id": "p1"}, {"returncode": None}) == 0
    run.worker = Worker([None])
    monkeypatch.setattr(flow, "EXIT_CODE_WAIT_S", 0.05)
    assert run._exit_code({"id": "p1"}, {"returncode": None}) is None
    assert run._exit_code({"id": "p1"}, {"returncode": 3}) == 3
