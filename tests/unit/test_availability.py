"""Availability traces: the CSV's checks, leave/return times, the scenario's steps."""
import json
import pickle

import pytest

from controller.model import availability as av
from controller.model.scenario import load_scenario
from controller.model.topology import Topology
from worker.api.errors import ConfigError


def topo(*names):
    t = Topology()
    for n in names:
        t.add_node(n)
    return t


def intervals(text):
    return av.by_name(av.parse_csv(text.encode(), "a.csv"))


def test_leave_and_return_times():
    got = intervals("node,t_on_s,t_off_s\nn1,0,120\nn1,300,\nn2,60,90\nn3,0,10\nn3,10,20\nn4,5,\n")
    assert av.leave_return_s(got["n1"], 1.0) == [(120.0, "leave"), (300.0, "return")]
    assert av.leave_return_s(got["n2"], 0.5) == [(0.0, "leave"), (30.0, "return"), (45.0, "leave")]
    assert av.leave_return_s(got["n3"], 1.0) == [(20.0, "leave")]  # adjacent intervals: no gap
    assert av.leave_return_s(got["n4"], 2.0) == [(0.0, "leave"), (10.0, "return")]


@pytest.mark.parametrize("text,needle", [
    ("node,t_on_s,t_off_s\nn1,0,10\nn1,5,20\n", "line 3: 'n1''s interval from 5 s overlaps the one of line 2"),
    ("node,t_on_s,t_off_s\nn1,30,10\n", "line 2: the interval goes backwards"),
    ("node,t_on_s,t_off_s\nn1,0,\nn1,50,60\n", "overlaps the one of line 2 (0 s to the end)"),
    ("node,t_on_s,t_off_s\nn1,-1,10\n", "line 2, column 't_on_s'"),
    ("node,t_on_s,t_off_s\nn1,nan,10\n", "line 2, column 't_on_s'"),
    ("node,t_on_s,t_off_s\nn1,0\n", "line 2: expected 3 fields"),
    ("node,start,end\nn1,0,1\n", "line 1: expected the header"),
])
def test_bad_files_name_file_and_line(text, needle):
    with pytest.raises(ConfigError) as e:
        av.parse_csv(text.encode(), "a.csv")
    assert str(e.value).startswith("a.csv: ") and needle in str(e.value)


def test_a_pickle_is_refused_without_unpickling():
    data = pickle.dumps({"1": {"active": [0], "inactive": [10]}})
    with pytest.raises(ConfigError, match="a.csv: looks like a Python pickle"):
        av.parse_csv(data, "a.csv")


def scenario(tmp_path, csv_text, event):
    (tmp_path / "avail.csv").write_text(csv_text)
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"seed": 3, "events": [{"at": 5, "availability": {"file": "avail.csv", **event}}]}))
    return str(path)


def test_scenario_pause_mode_steps(tmp_path):
    path = scenario(tmp_path, "node,t_on_s,t_off_s\nn1,0,10\nn1,20,\nn2,4,8\n", {"time_scale": 0.5})
    steps = [(s.at_s, s.kind, s.target) for s in load_scenario(path, topo("n1", "n2")).steps]
    assert sorted(steps) == [(5.0, "pause", "n2"), (7.0, "resume", "n2"), (9.0, "pause", "n2"),
                             (10.0, "pause", "n1"), (15.0, "resume", "n1")]


def test_scenario_crash_mode_replaces(tmp_path):
    path = scenario(tmp_path, "node,t_on_s,t_off_s\nn1,0,10\nn1,20,30\n", {"mode": "crash"})
    steps = sorted(load_scenario(path, topo("n1")).steps, key=lambda s: s.at_s)
    assert [(s.at_s, s.kind) for s in steps] == [(15.0, "crash"), (25.0, "replace"), (35.0, "crash")]
    assert steps[1].params == {"node": "n1", "revoked_at_s": 15.0}


def test_scenario_unknown_node_names_the_line(tmp_path):
    path = scenario(tmp_path, "node,t_on_s,t_off_s\nn1,0,10\nn9,0,10\n", {})
    with pytest.raises(ConfigError, match=r"avail.csv: line 3, field 'node': unknown node 'n9'"):
        load_scenario(path, topo("n1"))


def test_seeded_pick_of_clients(tmp_path):
    rows = "".join(f"c{i},{i},{i + 5}\n" for i in range(1000))
    path = scenario(tmp_path, "node,t_on_s,t_off_s\n" + rows, {"clients": "pick"})
    names = [f"n{i}" for i in range(100)]
    first = load_scenario(path, topo(*names)).steps
    again = load_scenario(path, topo(*names)).steps
    assert [(s.at_s, s.kind, s.target, s.detail) for s in first] == [(s.at_s, s.kind, s.target, s.detail) for s in again]
    assert {s.target for s in first} == set(names)
    clients = {s.detail.split("client ")[1].rstrip(")") for s in first}
    assert len(clients) == 100  # each node plays its own client


def test_file_outside_the_scenario_folder_is_refused(tmp_path):
    path = tmp_path / "scenario.json"
    path.write_text(json.dumps({"events": [{"at": 0, "availability": {"file": "../x.csv"}}]}))
    with pytest.raises(ConfigError, match="outside the directory"):
        load_scenario(str(path), topo("n1"))
