"""How long a gossip node waits for models (``wait_policy``), the done notices that end the
wait early, and sends that a finished neighbour refuses."""
import time

import numpy as np
import pytest

from dml_app.roles import gossip
from dml_app.roles.gossip import GossipRole
from dml_app.roles.memory import MemoryNetwork
from dml_app.runtime.events import read_events
from dml_app.runtime.http import HttpError, Request
from tests.unit.test_roles_memory import events_of, role_of, run_all


def _role(tmp_path, conf: dict) -> GossipRole:
    net = MemoryNetwork()
    tmp_path = tmp_path / conf.get("wait_policy", "adaptive")
    tmp_path.mkdir(exist_ok=True)
    return role_of(GossipRole, tmp_path, net, "n1", {"sync": 3, "epoch": 0, **conf}, ["n1", "n2", "n3"])


def _done(role: GossipRole, sender: str) -> None:
    role.on_done(Request("POST", "/gossip/done", {}, b"{}", "application/json", sender=sender, hop=sender))


def _model(role: GossipRole) -> list[np.ndarray]:
    return role.ctx.model.get_weights()


def test_an_adaptive_node_does_not_wait_once_every_sender_is_done(tmp_path):
    role = _role(tmp_path, {"wait_s": 30, "senders": ["n2", "n3"]})
    _done(role, "n2")
    _done(role, "n3")
    t0 = time.monotonic()
    assert role.gather(2, t0) == []
    assert time.monotonic() - t0 < 1.0


def test_a_model_already_in_the_inbox_is_taken_even_when_its_sender_is_done(tmp_path):
    role = _role(tmp_path, {"wait_s": 30, "senders": ["n2"]})
    role.deliver("n2", _model(role))
    _done(role, "n2")
    received = role.gather(2, time.monotonic())
    assert [peer for peer, _ in received] == ["n2"]


def test_a_done_notice_ends_a_wait_under_way(tmp_path):
    import threading

    role = _role(tmp_path, {"wait_s": 30, "senders": ["n2"]})
    threading.Timer(0.3, _done, args=(role, "n2")).start()
    t0 = time.monotonic()
    assert role.gather(2, t0) == []
    assert 0.25 < time.monotonic() - t0 < 3.0


def test_a_fixed_node_waits_the_whole_wait_s_whatever_the_notices(tmp_path):
    role = _role(tmp_path, {"wait_s": 0.5, "senders": ["n2"], "wait_policy": "fixed"})
    _done(role, "n2")
    t0 = time.monotonic()
    assert role.gather(2, t0) == []
    assert time.monotonic() - t0 >= 0.5


def test_the_adaptive_wait_is_a_few_median_gaps_after_the_last_arrival_within_wait_s(tmp_path):
    role = _role(tmp_path, {"wait_s": 10, "senders": ["n2", "n3"]})
    assert role.wait_deadline(100.0) == 110.0  # no arrivals seen, no round run: up to wait_s
    role.work_s = 1.5  # then: a few of its own rounds of work
    assert role.wait_deadline(100.0) == pytest.approx(100.0 + gossip.WAIT_GAPS * 1.5)
    role.arrivals.extend([90.0, 91.0, 92.0, 93.0, 97.0])  # gaps 1, 1, 1, 4: median 1
    assert role.wait_deadline(97.5) == pytest.approx(97.0 + gossip.WAIT_GAPS * 1.0)  # from the last arrival
    assert role.wait_deadline(100.0) == pytest.approx(100.0 + gossip.MIN_WAIT_S)  # overdue: the shortest wait
    role.arrivals.extend(100.0 + 20.0 * k for k in range(gossip.GAPS_KEPT + 1))  # gaps of 20: capped by wait_s
    assert role.wait_deadline(role.arrivals[-1]) == role.arrivals[-1] + 10.0
    role.arrivals.extend([1000.0] * (gossip.GAPS_KEPT + 1))  # a burst: gaps of 0, the shortest wait applies
    assert role.wait_deadline(1000.0) == pytest.approx(1000.0 + gossip.MIN_WAIT_S)
    fixed = _role(tmp_path, {"wait_s": 10, "wait_policy": "fixed"})
    fixed.arrivals.extend([90.0, 91.0, 92.0, 93.0, 97.0])
    assert fixed.wait_deadline(100.0) == 110.0


def test_only_a_sender_may_say_it_is_done(tmp_path):
    role = _role(tmp_path, {"senders": ["n2"]})
    with pytest.raises(HttpError) as e:
        _done(role, "n3")
    assert e.value.status == 403 and role.done_senders == set()


def test_a_bad_wait_policy_is_refused(tmp_path):
    with pytest.raises(ValueError, match="wait_policy must be one of adaptive, fixed"):
        _role(tmp_path, {"wait_policy": "eager"})


def test_a_send_refused_by_a_finished_peer_goes_to_another_and_that_peer_is_not_tried_again(tmp_path):
    role = _role(tmp_path, {})
    role.rng.shuffle = lambda peers: peers.sort()  # n2 first
    answers, tried = {"n2": {"accepted": False}, "n3": {}}, []

    def post_weights_answer(peer, round_no):
        tried.append(peer)
        return answers[peer]

    role.post_weights_answer = post_weights_answer
    role.send(1)
    role.send(2)
    assert tried == ["n2", "n3", "n3"] and role.done_peers == {"n2"}
    fixed = _role(tmp_path, {"wait_policy": "fixed"})
    fixed.rng.shuffle = lambda peers: peers.sort()
    fixed.post_weights_answer = post_weights_answer
    tried.clear()
    fixed.send(1)  # EdgeTB's: the model is lost
    assert tried == ["n2"]


def test_gossip_nodes_with_a_long_wait_s_end_without_a_waiting_tail(tmp_path):
    """Nodes of different speeds: the fast ones finish, tell their out-neighbours, and nobody
    waits out a 30 s ``wait_s`` for a model that cannot come."""
    net = MemoryNetwork()
    names = ["g1", "g2", "g3", "g4"]
    roles = []
    for i, n in enumerate(names):
        conf = {"sync": 6 + 2 * i, "epoch": 0, "wait_s": 30, "senders": [p for p in names if p != n]}
        roles.append(role_of(GossipRole, tmp_path, net, n, conf, names, seed=i))
    t0 = time.monotonic()
    results = run_all(roles, timeout_s=120)
    took_s = time.monotonic() - t0
    assert all(results[r.ctx.name]["rounds"] == r.sync for r in roles)
    assert took_s < 15, f"the run took {took_s:.1f} s: a node waited out wait_s"
    waited = [e["waited_s"] for r in roles for e in events_of(r, "round")]
    assert len(waited) == 6 + 8 + 10 + 12 and max(waited) < 15
    failed_sends = [e for r in roles for e in read_events(r.ctx.events.path) if e["type"] == "send_failed"]
    assert failed_sends == []  # every notice and model was taken


def test_models_wait_for_a_go_ahead_only_once_a_neighbour_has_finished(tmp_path):
    from dml_app.runtime.transport import HttpTransport

    role = _role(tmp_path, {"wait_s": 30, "senders": ["n2", "n3"]})
    role.transport = HttpTransport({}, None)
    assert role.transport.expect_continue is False  # the bulk of a run: bodies go at once
    _done(role, "n2")
    assert role.transport.expect_continue is True  # the end near: a finished peer refuses from the headers
