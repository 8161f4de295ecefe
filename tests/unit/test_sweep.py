"""Sweeps without running anything: the sweep file (controller.model.sweep), the checks and the
bookkeeping of controller.sweep, and the table (controller.results.sweep_table)."""
from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from controller import sweep as runner
from controller.model.sweep import expand_values, load_sweep, parse_path, set_path
from controller.results import sweep_table as table
from worker.api.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def exp(tmp_path: Path) -> Path:
    """The default experiment's files, gossip and FL."""
    for name in ("links.json", "gl_structure.json", "gl_dataset.json", "fl_structure.json", "fl_dataset.json"):
        (tmp_path / name).write_text((ROOT / name).read_text())
    return tmp_path


def sweep_file(exp: Path, doc: dict, name: str = "sweep.json") -> str:
    (exp / name).write_text(json.dumps(doc))
    return str(exp / name)


# paths and values ------------------------------------------------------------------------------------
def test_a_parameter_path_reads_keys_items_and_wildcards():
    p = parse_path("links.*[*].bw", "s.json")
    assert (p.file, p.steps) == ("links", ("*", "*", "bw"))
    assert parse_path("structure.node_list[0].sync", "s.json").steps == ("node_list", 0, "sync")


@pytest.mark.parametrize("text,message", [
    ("structur.sync", "unknown parameter 'structur.sync'.*did you mean 'structure'"),
    ("structure", "names a whole file"),
    ("structure.node_list[x]", r"cannot read '\[x\]'"),
    ("structure..sync", "cannot read"),
])
def test_a_bad_parameter_path_is_refused_naming_the_place(text, message):
    with pytest.raises(ConfigError, match=f"^s.json: vary: .*{message}"):
        parse_path(text, "s.json: vary")


def test_set_path_writes_every_match_and_adds_an_absent_key():
    doc = {"n1": [{"bw": "1mbit"}, {"bw": "2mbit"}], "n2": [{"bw": "3mbit"}]}
    assert set_path(doc, parse_path("links.*[*].bw", "w"), "5mbit", "w") == 3
    assert {link["bw"] for links in doc.values() for link in links} == {"5mbit"}
    s = {"sync": 2}
    assert set_path(s, parse_path("structure.model.seed", "w"), 4, "w") == 1 and s["model"] == {"seed": 4}


@pytest.mark.parametrize("path,message", [
    ("links.n1[5].bw", "n1 has 2 items"),
    ("links.n1.bw", "n1 is a list, not an object"),
    ("links.n3[*].bw", "n3 is empty"),
    ("links.n1[0].bw.x", r"n1\[0\].bw is the string '1mbit', not an object"),
])
def test_set_path_refuses_an_unknown_path(path, message):
    doc = {"n1": [{"bw": "1mbit"}, {"bw": "2mbit"}], "n3": []}
    with pytest.raises(ConfigError, match=f"^s.json: unknown parameter path '{re.escape(path)}': {message}"):
        set_path(doc, parse_path(path, "s.json"), "5mbit", "s.json")


def test_values_as_lists_and_ranges():
    assert expand_values(["a", "b"], "w") == ["a", "b"]
    assert expand_values({"from": 2, "to": 10, "step": 4}, "w") == [2, 6, 10]
    assert expand_values({"from": 0.1, "to": 0.3, "count": 3}, "w") == [0.1, 0.2, 0.3]
    assert expand_values({"from": 1, "to": 100, "count": 3, "scale": "log"}, "w") == [1, 10, 100]
    assert expand_values({"from": 5, "to": 1, "step": 2}, "w") == [5, 3, 1]
    with pytest.raises(ConfigError, match="lists no value"):
        expand_values([], "w")
    with pytest.raises(ConfigError, match="either 'step' or 'count'"):
        expand_values({"from": 1, "to": 2}, "w")
    with pytest.raises(ConfigError, match="field 'stepp': unknown field; did you mean 'step'"):
        expand_values({"from": 1, "to": 2, "stepp": 1}, "w")


# the sweep file ----------------------------------------------------------------------------------------
def test_the_grid_is_every_combination_times_the_seeds_less_the_excluded(exp):
    s = load_sweep(sweep_file(exp, {"vary": {"algorithm": ["gossip", "fl"], "links.*[*].bw": ["5mbit", "20mbit"]},
                                    "repeats": {"seeds": [3, 7]},
                                    "exclude": [{"algorithm": "fl", "links.*[*].bw": "5mbit"}]}))
    got = [(r.index, r.config, r.params["algorithm"], r.params["links.*[*].bw"], r.seed) for r in s.runs]
    assert got == [(1, 1, "gossip", "5mbit", 3), (2, 1, "gossip", "5mbit", 7), (3, 2, "gossip", "20mbit", 3),
                   (4, 2, "gossip", "20mbit", 7), (5, 3, "fl", "20mbit", 3), (6, 3, "fl", "20mbit", 7)]
    assert len({r.name for r in s.runs}) == 6 and s.out == str(exp / "dml_file" / "sweeps" / "sweep")
    assert s.file_of("structure", "fl") == "fl_structure.json" and s.file_of("links", "fl") == "links.json"
    assert [p.text for p in s.seed_paths] == ["structure.model.seed", "dataset.seed"]


def test_repeats_as_a_count_and_without(exp):
    assert [r.seed for r in load_sweep(sweep_file(exp, {"vary": {"structure.sync": [2]}, "repeats": 3})).runs] \
        == [0, 1, 2]
    assert [r.seed for r in load_sweep(sweep_file(exp, {"vary": {"structure.sync": [2, 3]}})).runs] == [None, None]


@pytest.mark.parametrize("doc,message", [
    ({"vary": {}}, "field 'vary': names no parameter"),
    ({}, "missing field 'vary'"),
    ({"vary": {"algorithm": ["gossip", "fedavg"]}}, r"vary\['algorithm'\], value 1: unknown algorithm 'fedavg'"),
    ({"vary": {"structure.sync": [2, 2]}}, "a value is listed twice"),
    ({"vary": {"structure.sync": [2]}, "exclude": [{"structure.sync": 2}]}, "leaves out every configuration"),
    ({"vary": {"structure.sync": [2]}, "exclude": [{"structure.syn": 2}]}, "not a varied parameter; did you mean"),
    ({"vary": {"structure.sync": [2]}, "exclude": [{"structure.sync": 5}]}, "5 is not among the values"),
    ({"vary": {"structure.sync": [2]}, "repeats": {"seeds": [1, 1]}}, "a seed is listed twice"),
    ({"vary": {"structure.model.seed": [2]}, "repeats": 2}, "both varied and set to the seed"),
    ({"vary": {"structure.sync": [2]}, "out": "/tmp/elsewhere"}, "field 'out'"),
    ({"vary": {"structure.sync": [2]}, "base": {"links": "../links.json"}}, "field 'links'"),
    ({"vary": {"structure.sync": [2]}, "base": {"structure": {"gosip": "x.json"}}}, "did you mean 'gossip'"),
    ({"vary": {"structure.sync": [2]}, "runs": 3}, "field 'runs': unknown field; did you mean 'run'"),
    ({"vary": {"structure.sync": [2]}, "hosts": "hosts.json"}, "field hosts: a sweep runs on this host only"),
    ({"vary": {"structure.sync": [2]}, "run": {"hosts": "h.json"}}, "run, field hosts: a sweep runs on this host"),
    ({"vary": {"structure.sync": [2]}, "base": {"hosts": "h.json"}}, "base, field hosts: .*--hosts FILE"),
])
def test_a_bad_sweep_file_is_refused_naming_it_and_the_place(exp, doc, message):
    with pytest.raises(ConfigError, match=f"^sweep.json.*{message}"):
        load_sweep(sweep_file(exp, doc))


@pytest.mark.parametrize("vary,message", [
    ({"structure.sync": [2, 0]}, r"vary\['structure.sync'\] value 1 \(0\), gossip: gl_structure.json: field 'sync'"),
    ({"structure.epochs": [2]}, "field 'epochs': unknown field; did you mean 'epoch'"),
    ({"links.*[*].bw": ["5mbitt"]}, "links.json: node 'n1'.*field 'bw'"),
    ({"links.n1[9].bw": ["5mbit"]}, "unknown parameter path 'links.n1\\[9\\].bw': n1 has 3 items"),
    ({"algorithm": ["gossip", "fl"], "structure.wait_s": [2]}, "fl: fl_structure.json: field 'wait_s'"),
    ({"scenario.seed": [1]}, "the gossip runs have no scenario file"),
])
def test_a_value_the_files_refuse_is_refused_before_any_run(exp, vary, message):
    s = load_sweep(sweep_file(exp, {"vary": vary}))
    with pytest.raises(ConfigError, match=f"^sweep.json: .*{message}"):
        runner.check(s)


def test_the_check_passes_and_makes_the_changed_files_only(exp, tmp_path):
    s = load_sweep(sweep_file(exp, {"vary": {"links.*[*].bw": ["5mbit"]}, "repeats": 2}))
    runner.check(s)
    paths = runner.Files(s).make("gossip", runner.run_values(s, s.runs[1]), str(tmp_path / "made"))
    assert paths["links"].startswith(str(tmp_path / "made")) and paths["structure"].startswith(str(tmp_path / "made"))
    assert json.loads(Path(paths["structure"]).read_text())["model"]["seed"] == 1
    assert json.loads(Path(paths["dataset"]).read_text())["seed"] == 1
    argv = runner.command(s, "gossip", paths)
    assert argv[1].endswith("gl_run.py") and "--auto" in argv
    assert argv[argv.index("--links") + 1] == str(Path(paths["links"]).relative_to(exp))


# resuming ------------------------------------------------------------------------------------------------
def test_pending_keeps_completed_and_failed_runs(exp):
    s = load_sweep(sweep_file(exp, {"vary": {"structure.sync": [2, 3]}, "repeats": 2}))
    state = {"runs": {s.runs[0].key: {"status": "completed"}, s.runs[1].key: {"status": "failed"},
                      s.runs[2].key: {"status": "interrupted"}}}
    assert [r.index for r in runner.pending(s.runs, state)] == [3, 4]
    assert [r.index for r in runner.pending(s.runs, state, retry_failed=True)] == [2, 3, 4]
    assert runner.time_left_s([10.0, 20.0], 3) == 45.0 and runner.time_left_s([], 3) is None


def test_a_run_keeps_its_identity_when_the_grid_grows(exp):
    small = load_sweep(sweep_file(exp, {"vary": {"structure.sync": [2]}, "repeats": 2}))
    grown = load_sweep(sweep_file(exp, {"vary": {"structure.sync": [1, 2]}, "repeats": 2}))
    state = {"runs": {r.key: {"status": "completed"} for r in small.runs}}
    assert [r.params["structure.sync"] for r in runner.pending(grown.runs, state)] == [1, 1]


def test_resuming_marks_a_run_left_running_interrupted_and_refuses_changed_files(exp):
    s = load_sweep(sweep_file(exp, {"vary": {"structure.sync": [2]}}))
    files = runner.Files(s)
    d = runner.SweepDir(s.out)
    d.start(s, files.digest())
    d.record(s.runs[0], status="running")
    again = runner.SweepDir(s.out)
    again.start(s, files.digest())
    assert again.state["runs"][s.runs[0].key]["status"] == "interrupted"
    (exp / "gl_structure.json").write_text((exp / "gl_structure.json").read_text().replace('"sync": 20', '"sync": 5'))
    with pytest.raises(ConfigError, match="the experiment's files changed since the sweep"):
        runner.SweepDir(s.out).start(s, runner.Files(s).digest())


# the table --------------------------------------------------------------------------------------------------
def test_mean_and_student_interval():
    got = table.mean_ci95([1.0, 2.0, 3.0])
    assert got["mean"] == 2.0 and got["n"] == 3
    assert math.isclose(got["ci95"], 4.303 * 1.0 / math.sqrt(3), rel_tol=1e-9)
    assert table.mean_ci95([5.0, None])["ci95"] is None and table.mean_ci95([])["mean"] is None
    assert table.t_975(1) == 12.706 and 1.96 < table.t_975(200) < 1.98


def _fake_run(folder: Path, accuracy: float, tta_s, bytes_each: int) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({
        "run_id": folder.parent.name, "accuracy": {"final_global_accuracy": {"mean": accuracy}},
        "nodes": [{"bytes_sent": bytes_each}, {"bytes_sent": bytes_each}],
        "time_to_accuracy": [{"target": 0.8, "run": None if tta_s is None else
                              {"time_s": tta_s, "rounds": 2, "bytes_sent": 10}, "nodes": {}}]}))
    (folder / "metrics.csv").write_text("node,round,time_s\nn1,1,1.0\nn1,2,3.0\nn2,1,1.0\nn2,2,2.0\n")


def test_the_table_has_a_row_per_run_and_per_configuration(tmp_path):
    runs = []
    for i, (rate, seed, status) in enumerate([("5mbit", 0, "completed"), ("5mbit", 1, "completed"),
                                              ("20mbit", 0, "completed"), ("20mbit", 1, "failed")], 1):
        runs.append({"index": i, "name": f"{i:04d}-x", "key": f"k{i}", "config": 1 + (i > 2), "repeat": 1 + seed,
                     "seed": seed, "params": {"links.*[*].bw": rate}, "algorithm": "gossip"})
        _fake_run(tmp_path / "runs" / f"{i:04d}-x" / "run", 0.8 + 0.02 * i, None if i == 2 else 10.0 * i, 100 * i)
    (tmp_path / "plan.json").write_text(json.dumps({"varied": ["links.*[*].bw"],
                                                    "values": {"links.*[*].bw": ["5mbit", "20mbit"]}, "runs": runs}))
    (tmp_path / "state.json").write_text(json.dumps({"runs": {r["key"]: {"status": s, "seconds": 30.0} for r, s in
                                                              zip(runs, ["completed"] * 3 + ["failed"])}}))
    written = {}
    summary = table.build(str(tmp_path), lambda name, data: written.__setitem__(name, data))
    rows = list(csv.DictReader(written["runs.csv"].decode().splitlines()))
    assert [r["status"] for r in rows] == ["completed", "completed", "completed", "failed"]
    assert rows[0]["links.*[*].bw"] == "5mbit" and rows[0]["bytes_sent"] == "200" and rows[0]["round_s"] == "1.5"
    assert rows[0]["tta_0.8_s"] == "10" and rows[1]["tta_0.8_s"] == ""
    configs = list(csv.DictReader(written["configs.csv"].decode().splitlines()))
    assert [(c["config"], c["runs"], c["completed"], c["failed"]) for c in configs] == [("1", "2", "2", "0"),
                                                                                           ("2", "2", "1", "1")]
    assert float(configs[0]["final_accuracy_mean"]) == pytest.approx(0.83)
    assert float(configs[0]["final_accuracy_ci95"]) == pytest.approx(12.706 * 0.01, rel=1e-3)  # s = 0.01414, n = 2
    assert configs[0]["tta_0.8_s_n"] == "1" and configs[1]["final_accuracy_n"] == "1"
    assert summary["status"]["failed"] == 1 and summary["targets"] == [0.8] and not summary["problems"]
    assert summary["plots"] and all(written[p][:8] == b"\x89PNG\r\n\x1a\n" for p in summary["plots"])


def test_analyze_refuses_a_folder_that_is_no_sweep(tmp_path):
    with pytest.raises(ConfigError, match="is not a sweep folder"):
        runner.analyze_sweep(str(tmp_path))


def test_a_varied_scenario_takes_its_trace_files_along(exp, tmp_path):
    (exp / "traces").mkdir()
    (exp / "traces" / "bus.csv").write_text("time_s,rate\n0,5mbit\n10,1mbit\n")
    (exp / "scenario.json").write_text(json.dumps({"seed": 1, "events": [
        {"at": 0, "trace": {"src": "n1", "dst": "n2", "file": "traces/bus.csv"}}]}))
    s = load_sweep(sweep_file(exp, {"base": {"scenario": "scenario.json"}, "vary": {"scenario.seed": [2, 3]}}))
    runner.check(s)
    paths = runner.Files(s).make("gossip", runner.run_values(s, s.runs[0]), str(tmp_path / "made"))
    assert paths["scenario"] == str(tmp_path / "made" / "scenario.json")
    assert (tmp_path / "made" / "traces" / "bus.csv").read_text() == (exp / "traces" / "bus.csv").read_text()
    assert paths["links"] == str(exp / "links.json")  # not varied: the base file itself


def test_trace_files_are_found_at_any_depth():
    links = {"n1": [{"dest": "n2", "trace": {"file": "traces/a.csv"}}], "n2": [{"dest": "n1", "bw": "1mbit"}]}
    scenario = {"events": [{"at": 0, "trace": {"src": "n1", "dst": "n2", "file": "b.log"}}]}
    assert list(runner.trace_files(links)) == ["traces/a.csv"] and list(runner.trace_files(scenario)) == ["b.log"]


def test_a_varied_links_file_takes_its_trace_files_along(exp, tmp_path):
    (exp / "traces").mkdir()
    (exp / "traces" / "bus.csv").write_text("time_s,rate\n0,5mbit\n10,1mbit\n")
    links = json.loads((exp / "links.json").read_text())
    links["n1"][0] = {"dest": links["n1"][0]["dest"], "trace": {"file": "traces/bus.csv", "format": "csv"}}
    (exp / "links.json").write_text(json.dumps(links))
    s = load_sweep(sweep_file(exp, {"vary": {"links.n2[0].bw": ["1mbit", "2mbit"]}}))
    runner.check(s)
    runner.Files(s).make("gossip", runner.run_values(s, s.runs[0]), str(tmp_path / "made"))
    assert (tmp_path / "made" / "traces" / "bus.csv").exists()


def test_a_grown_grid_keeps_the_folders_of_its_runs(exp):
    small = load_sweep(sweep_file(exp, {"vary": {"structure.sync": [2]}}))
    d = runner.SweepDir(small.out)
    d.start(small, runner.Files(small).digest())
    d.record(small.runs[0], status="completed")
    grown = load_sweep(sweep_file(exp, {"vary": {"structure.sync": [1, 2]}}))
    again = runner.SweepDir(grown.out)
    again.start(grown, runner.Files(grown).digest())
    kept = grown.runs[1]
    assert kept.name != small.runs[0].name and again.name(kept) == small.runs[0].name
    plan = json.loads((Path(grown.out) / "plan.json").read_text())
    assert [r["name"] for r in plan["runs"]] == [grown.runs[0].name, small.runs[0].name]
