"""Global evaluation at a chosen cost: the schedule (``eval_every``), the fixed sample
(``global_eval_n``), the last round on the whole set, and the structure files' refusals."""
import csv
import io
import json

import numpy as np
import pytest

from controller.confs.structures import DEFAULT_GLOBAL_EVAL_N, load_structure_file
from controller.model.topology import load_links
from controller.results import tables
from controller.run.progress import read_report
from dml_app.roles.base import Context, Role, RoundRecord
from dml_app.roles.global_eval import EvalPlan, GlobalSample, sample_indices
from dml_app.runtime.events import EventLog, read_events
from worker.api.errors import ConfigError

RUN = "20260101-000000-abcd"
TRAINED = {"loss": 0.5, "train_s": 0.1}


class Recorder:
    """A model that answers an evaluation with (the first label, the number of samples)."""

    def __init__(self) -> None:
        self.seen: list[np.ndarray] = []

    def get_weights(self) -> list[np.ndarray]:
        return [np.zeros(2, np.float32)]

    def evaluate(self, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        self.seen.append(y.copy())
        return float(len(y)), 0.5


def _role(tmp_path, name: str, conf: dict, total: int = 300) -> tuple[Role, Recorder, EventLog]:
    model = Recorder()
    events = EventLog(str(tmp_path / f"{name}.jsonl"), RUN, name)
    data = (np.zeros((4, 2), np.float32), np.zeros(4, np.int64), np.zeros((3, 2), np.float32), np.zeros(3, np.int64))
    global_test = (np.arange(total * 2, dtype=np.float32).reshape(total, 2), np.arange(total))
    ctx = Context(name, model, data, conf, {}, events, lambda msg, **f: None, global_test=global_test)
    return Role(ctx), model, events


def _run(role: Role, rounds: int) -> None:
    for r in range(1, rounds + 1):
        role.record_round(RoundRecord(r, 0.0, TRAINED, *role.evaluate(r), 0.0, 0))


def _round_events(events: EventLog) -> list[dict]:
    return [e for e in read_events(events.path) if e["type"] == "round"]


# the pure logic -------------------------------------------------------------------------------
def test_the_sample_is_fixed_by_the_seed_and_sorted():
    a, b = sample_indices(10_000, 1000, 7), sample_indices(10_000, 1000, 7)
    assert np.array_equal(a, b) and len(a) == 1000 and len(set(a.tolist())) == 1000
    assert np.all(np.diff(a) > 0) and a.max() < 10_000
    assert not np.array_equal(a, sample_indices(10_000, 1000, 8))
    assert np.array_equal(sample_indices(500, 1000, 7), np.arange(500))  # n of the whole set or more: all
    assert np.isin(sample_indices(10_000, 100, 7), a).all()  # a smaller sample is part of a larger one


def test_the_plan_evaluates_every_kth_round_and_the_last_on_everything():
    plan = EvalPlan(every=3, sample_n=50)
    assert [plan.size(r, r == 7, 300) for r in range(1, 8)] == [0, 0, 50, 0, 0, 50, 300]
    assert EvalPlan().size(1, False, 300) == 300 and EvalPlan(sample_n=1000).size(2, False, 300) == 300
    assert EvalPlan.of({}) == EvalPlan(1, None, 0)
    assert EvalPlan.of({"eval_every": 2, "global_eval_n": 10, "global_eval_seed": 4}) == EvalPlan(2, 10, 4)


@pytest.mark.parametrize("conf,words", [
    ({"eval_every": 0}, "eval_every must be a whole number >= 1, got 0"),
    ({"eval_every": 1.5}, "eval_every must be a whole number >= 1, got 1.5"),
    ({"global_eval_n": 0}, "global_eval_n must be a whole number >= 1, got 0"),
    ({"global_eval_n": True}, "global_eval_n must be a whole number >= 1, got True"),
    ({"global_eval_seed": -1}, "global_eval_seed must be a whole number >= 0, got -1"),
])
def test_a_node_refuses_a_bad_plan(conf, words):
    with pytest.raises(ValueError, match=words):
        EvalPlan.of(conf)


def test_the_sample_is_drawn_once_per_set():
    x, y = np.arange(20, dtype=np.float32).reshape(10, 2), np.arange(10)
    sample = GlobalSample()
    first = sample.take((x, y), 4, 1)
    assert sample.take((x, y), 4, 1)[0] is first[0] and np.array_equal(first[1], sample_indices(10, 4, 1))
    assert sample.take((x, y), 10, 1)[1] is y  # the whole set: no copy


# on a node ------------------------------------------------------------------------------------
def test_every_node_and_every_round_evaluates_the_same_sample_and_the_last_round_everything(tmp_path):
    conf = {"sync": 5, "eval_every": 2, "global_eval_n": 50, "global_eval_seed": 3}
    seen = []
    for name in ("n1", "n2"):
        role, model, events = _role(tmp_path, name, conf)
        _run(role, 5)
        seen.append(model.seen)
        rounds = _round_events(events)
        assert [e["global_eval_n"] for e in rounds] == [0, 50, 0, 50, 300]
        assert [e["global_accuracy"] for e in rounds] == [None, 0.5, None, 0.5, 0.5]
        assert [e["global_loss"] for e in rounds] == [None, 50.0, None, 50.0, 300.0]
    # (each round: the local shard, then the global sample; rounds 1 and 3: the local shard only)
    sampled = [s for s in seen[0] if len(s) == 50]
    assert len(sampled) == 2 and np.array_equal(sampled[0], sampled[1])
    assert np.array_equal(sampled[0], sample_indices(300, 50, 3))
    assert all(np.array_equal(a, b) for a, b in zip(seen[0], seen[1]))
    assert np.array_equal(seen[0][-1], np.arange(300))


def test_without_a_global_set_nothing_is_counted(tmp_path):
    role, _, events = _role(tmp_path, "n1", {"sync": 2, "eval_every": 2})
    role.ctx.global_test = None
    _run(role, 2)
    assert [e["global_eval_n"] for e in _round_events(events)] == [None, None]


def test_a_role_that_gives_no_round_number_follows_its_round_count(tmp_path):
    role, _, events = _role(tmp_path, "n1", {"sync": 3, "eval_every": 2, "global_eval_n": 20})
    for r in range(1, 4):  # a user's role calling evaluate() as before
        role.record_round(RoundRecord(r, 0.0, TRAINED, *role.evaluate(), 0.0, 0))
    assert [e["global_eval_n"] for e in _round_events(events)] == [0, 20, 300]


def test_metrics_csv_counts_the_samples_and_leaves_a_skipped_round_empty(tmp_path):
    role, _, events = _role(tmp_path, "n1", {"sync": 3, "eval_every": 2, "global_eval_n": 50})
    _run(role, 3)
    rows = tables.metric_rows({"n1": read_events(events.path)}, 0.0, "gossip")
    text = tables.csv_bytes(tables.METRIC_COLUMNS, rows).decode()
    got = [(r["round"], r["global_eval_n"], r["global_accuracy"]) for r in csv.DictReader(io.StringIO(text))]
    assert got == [("1", "0", ""), ("2", "50", "0.5"), ("3", "300", "0.5")]


def test_a_skipped_round_adds_no_accuracy_to_the_live_series():
    skipped = read_report("n1", {"round": 3, "accuracy": 0.7, "loss": 1.0, "global_eval_n": 0}, 10, set())
    evaluated = read_report("n1", {"round": 4, "accuracy": 0.7, "global_accuracy": 0.8, "global_eval_n": 50}, 10, set())
    local_only = read_report("n1", {"round": 4, "accuracy": 0.7, "loss": 1.0}, 10, set())
    assert skipped.best_accuracy is None and skipped.best_loss is None and skipped.accuracy == 0.7
    assert evaluated.best_accuracy == 0.8 and local_only.best_accuracy == 0.7


# the structure files --------------------------------------------------------------------------
STRUCTURES = {
    "gossip": {"sync": 3, "node_list": [{"name": "n1"}, {"name": "n2"}]},
    "fl": {"sync": 3, "node_list": [{"name": "n1"}, {"name": "n2"}]},
    "etree": {"node_list": [{"name": "n1", "layer": 2, "sync": 3, "child_num": 2}, {"name": "n1", "layer": 1},
                            {"name": "n2", "layer": 1}]},
    "ring": {"sync": 3, "node_list": [{"name": "n1"}, {"name": "n2"}]},
}


def _load(tmp_path, algorithm: str, **top) -> dict:
    (tmp_path / "links.json").write_text(json.dumps({"n1": [{"dest": "n2", "bw": "1mbit"}],
                                                     "n2": [{"dest": "n1", "bw": "1mbit"}]}))
    (tmp_path / "s.json").write_text(json.dumps({**STRUCTURES[algorithm], **top}))
    return load_structure_file(str(tmp_path / "s.json"), load_links(str(tmp_path / "links.json")), algorithm)


@pytest.mark.parametrize("algorithm", list(STRUCTURES))
def test_every_algorithm_passes_the_settings_to_every_node(tmp_path, algorithm):
    default = _load(tmp_path, algorithm)
    assert {(c["eval_every"], c["global_eval_n"], c["global_eval_seed"]) for c in default.values()} == {
        (1, DEFAULT_GLOBAL_EVAL_N, 0)}
    chosen = _load(tmp_path, algorithm, eval_every=5, global_eval_n=None, model={"seed": 9})
    assert {(c["eval_every"], c["global_eval_n"], c["global_eval_seed"]) for c in chosen.values()} == {(5, None, 9)}
    assert EvalPlan.of(chosen["n2"]) == EvalPlan(5, None, 9)


def test_the_sample_seed_is_the_top_level_models_not_an_entrys(tmp_path):
    confs = _load(tmp_path, "gossip", model={"seed": 2}, node_list=[{"name": "n1", "seed": 5}, {"name": "n2"}])
    assert confs["n1"]["model"]["seed"] == 5 and {c["global_eval_seed"] for c in confs.values()} == {2}


@pytest.mark.parametrize("algorithm", list(STRUCTURES))
@pytest.mark.parametrize("field,value,words", [
    ("eval_every", 0, "field 'eval_every': must be an integer in [1, 100000], got 0"),
    ("eval_every", 2.5, "field 'eval_every': expected an integer in [1, 100000], got 2.5"),
    ("eval_every", "2", "field 'eval_every': expected an integer in [1, 100000], got the string '2'"),
    ("global_eval_n", 0, "field 'global_eval_n': must be an integer in [1, 1000000] or null, got 0"),
    ("global_eval_n", True, "field 'global_eval_n': expected an integer in [1, 1000000] or null, got true"),
    ("global_eval_n", 10**7, "field 'global_eval_n': must be an integer in [1, 1000000] or null, got 10000000"),
])
def test_bad_values_are_refused_naming_the_file_and_field(tmp_path, algorithm, field, value, words):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, algorithm, **{field: value})
    assert str(e.value).startswith(str(tmp_path / "s.json")) and words in str(e.value)


def test_a_misspelt_field_is_named(tmp_path):
    with pytest.raises(ConfigError, match="field 'eval_evry': unknown field; did you mean 'eval_every'"):
        _load(tmp_path, "gossip", eval_evry=2)


def test_an_etree_evaluates_every_positions_last_round_on_everything(tmp_path):
    """The root's last global round says so down the tree: each position's last round, and no
    other (``eval_every`` 100), evaluates on the whole set."""
    from dml_app.roles.etree import ETreeRole
    from dml_app.roles.memory import MemoryNetwork
    from tests.unit.test_roles_memory import blobs, events_of, role_of, run_all

    net, names, plan = MemoryNetwork(), ["a", "b", "c"], {"eval_every": 100, "global_eval_n": 10}
    leaf = {"layer": 1, "parent": "b", "children": [], "sync": 1, "epoch": 1}
    middle = {"layer": 2, "parent": "a", "children": ["b", "c"], "sync": 2, "deadline_s": 20, "quorum": 1.0}
    top = {"layer": 3, "parent": None, "children": ["b"], "sync": 2, "deadline_s": 60, "quorum": 1.0}
    confs = {"a": {"positions": [top], "members": ["b", "c"]}, "b": {"positions": [middle, leaf]},
             "c": {"positions": [leaf]}}
    roles = [role_of(ETreeRole, tmp_path, net, n, {"sync": 2, "epoch": 1, "root": "a", **plan, **confs[n]}, names)
             for n in names]
    for role in roles:
        role.ctx.global_test = blobs(5, 40)
    run_all(roles)
    by_layer = {(r.ctx.name, e["layer"]): [] for r in roles for e in events_of(r, "round")}
    for r in roles:
        for e in events_of(r, "round"):
            by_layer[(r.ctx.name, e["layer"])].append(e["global_eval_n"])
    assert by_layer == {("a", 3): [0, 40], ("b", 2): [0, 0, 0, 40], ("b", 1): [0, 0, 0, 40], ("c", 1): [0, 0, 0, 40]}


def test_the_stored_dashboard_holds_the_last_evaluated_figure_through_a_skipped_round(tmp_path):
    from controller.web import run_view
    from tests.unit.test_dashboard import _stored_run

    _, run = _stored_run(tmp_path)
    lines = ["run_id,algorithm,node,role,layer,round,time_s,loss,accuracy,global_loss,global_accuracy,global_eval_n"]
    for offset, node in enumerate("abc"):
        for r in range(1, 6):
            evaluated = r % 2 == 0 or r == 5
            glob = f"1.0,{0.5 + 0.1 * r + 0.01 * offset},{50 if r < 5 else 300}" if evaluated else ",,0"
            lines.append(f"run1,gossip,{node},gossip,,{r},{1 + 2 * r},9.0,0.1,{glob}")
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    view = run_view.stored_view(str(run))
    rounds, t = view["series"]["round"], view["series"]["time"]
    assert rounds["round"] == [1, 2, 3, 4, 5] and rounds["acc_med"][0] is None and rounds["acc_med"][2] is None
    assert rounds["acc_med"][1] == pytest.approx(0.71) and rounds["acc_med"][4] == pytest.approx(1.01)
    assert t["acc_med"][t["t_s"].index(8.0)] == pytest.approx(0.71)  # after round 3 (skipped): round 2's
    assert t["loss_med"][t["t_s"].index(8.0)] == pytest.approx(1.0)  # the global loss, not the local 9.0
