"""Deploy's wait for the nodes: announcements first, HTTP only when they stop coming."""
import time
from types import SimpleNamespace

import pytest

from controller import experiment
from controller.experiment import Experiment
from worker.errors import TestbedTimeout


def waiter(names, announce, answers=()):
    """A stand-in for the experiment: ``announce`` maps a tick number to the nodes whose
    announcement arrives then; ``answers`` are the nodes that answer /health."""
    ticks, polled = [0], []
    nodes = {n: SimpleNamespace(up=False) for n in names}

    def sleep(s):
        time.sleep(s)
        ticks[0] += 1
        for n in announce.get(ticks[0], ()):
            nodes[n].up = True

    def health(name):
        polled.append(name)
        return {"state": "waiting"} if name in answers else None

    return SimpleNamespace(nodes=nodes, sleep=sleep, _health=health), polled


def test_announced_nodes_are_never_polled(monkeypatch):
    fake, polled = waiter(["a", "b", "c"], {1: ["a"], 3: ["b", "c"]})
    Experiment._wait_ready(fake, 30)
    assert polled == [] and all(n.up for n in fake.nodes.values())


def test_a_lost_announcement_is_found_over_http_after_a_quiet_spell(monkeypatch):
    monkeypatch.setattr(experiment, "READY_QUIET_S", 0.3)
    fake, polled = waiter(["a", "b"], {1: ["a"]}, answers=["b"])
    Experiment._wait_ready(fake, 30)
    assert "a" not in polled and "b" in polled and fake.nodes["b"].up


def test_nodes_that_never_answer_time_out_by_name(monkeypatch):
    monkeypatch.setattr(experiment, "READY_QUIET_S", 0.0)
    fake, _ = waiter(["a", "b"], {}, answers=["a"])
    with pytest.raises(TestbedTimeout, match="did not answer within 0s: b"):
        Experiment._wait_ready(fake, 0)
