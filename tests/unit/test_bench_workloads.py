"""bench_workloads.py's account of where a run's time went, from a run folder's events."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))

from bench_workloads import breakdown  # noqa: E402


def _round(no: int, t_start: float, t_end: float, train_cpu: float, eval_cpu: float, wait_s: float) -> dict:
    return {"type": "round", "round": no, "t_start": t_start, "t_end": t_end,
            "phases": {"train": [[t_start, t_start + 1, 10.0, 10.0 + train_cpu]],
                       "evaluate": [[t_start + 1, t_start + 2, 20.0, 20.0 + eval_cpu]],
                       "wait": [[t_end - wait_s, t_end]]}}


def test_breakdown_sums_the_nodes_phase_cpu_and_times_the_first_round_and_the_stragglers(tmp_path, monkeypatch):
    events = tmp_path / "events"
    events.mkdir()
    nodes = {"n1": [_round(1, 100.0, 110.0, 0.3, 0.2, 1.0), _round(2, 110.0, 120.0, 0.3, 0.1, 2.0)],
             "n2": [_round(1, 101.0, 112.0, 0.5, 0.2, 0.5), _round(2, 112.0, 121.0, 0.4, 0.1, 0.5)],
             "n3": [_round(1, 100.5, 111.0, 0.2, 0.2, 0.0), _round(2, 111.0, 130.0, 0.2, 0.2, 0.0)]}
    for name, rounds in nodes.items():
        (events / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [{"type": "started"}, *rounds]))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    got = breakdown(str(tmp_path), run_s=31.0, busy_s=50.0)
    assert got["train_cpu_s"] == pytest.approx(1.9) and got["eval_cpu_s"] == pytest.approx(1.0)
    assert got["floor_s"] == pytest.approx(1.45) and got["busy_s"] == pytest.approx(25.0)
    assert got["first_round_s"] == pytest.approx(12.0)  # the slowest node's first round ends 12 s after the first start
    assert got["straggle_s"] == pytest.approx(9.0)  # the last node ends 9 s after the median one
    assert got["wait_s_node"] == pytest.approx(4.0 / 3) and got["run_s"] == 31.0


def test_breakdown_of_a_run_without_rounds_is_empty(tmp_path):
    (tmp_path / "events").mkdir()
    assert breakdown(str(tmp_path), run_s=1.0, busy_s=1.0) == {}
