"""Adaptation policies: the built-in rules on hand-made votes, the noise-scale estimator on
gradients of a known noise scale, and policies deciding together in a ring run in memory."""
from typing import Any

import numpy as np
import pytest

from dml_app.policies.builtin import AdaptiveBatch, AdaptiveStrategy
from dml_app.policies.contract import Policy, PolicyError, PolicyView, check_action, check_vote
from dml_app.policies.monitors import NoiseScale, grad_var
from dml_app.roles.memory import MemoryNetwork
from dml_app.roles.ring import RingRole, StrategyRefused
from dml_app.roles.ring_membership import Formation
from tests.unit.test_roles_memory import events_of, role_of, run_all

MEMBERS = ["a", "b", "c", "d"]


def view(strategy: str = "star:a", batch: int = 32) -> PolicyView:
    return PolicyView("a", "ring", list(MEMBERS), strategy, batch)


def votes_of(flags: list[bool], **extra: Any) -> dict[str, dict]:
    return {m: {"vote": f, **extra} for m, f in zip(MEMBERS, flags)}


def test_kungfu_mode_switches_once_when_more_than_half_vote_and_a_tie_is_no_majority():
    p = AdaptiveStrategy({"mode": "kungfu", "alternative": "ring", "warmup_rounds": 1}, view())
    assert [p.after_round({"comm_goodput_bps": g})["vote"] for g in (50.0, 100.0, 90.0, 79.0)] == \
        [False, False, False, True]  # the reference is round 2's 100 (the first after the warm-up)
    assert p.decide(5, votes_of([True, True, False, False])) is None  # 2 of 4: a tie is no majority
    assert p.decide(5, votes_of([True, True, True, False]))["strategy"] == "ring"
    assert p.decide(6, votes_of([True] * 4)) is None  # at most once


def test_robust_mode_uses_medians_a_cooldown_and_the_measured_edges():
    p = AdaptiveStrategy({"mode": "robust", "reference_rounds": 5, "window_rounds": 3, "cooldown_rounds": 5},
                         view("star:a"))
    for g in (100, 100, 100, 100, 100, 40):  # one slow round: the median of the last 3 is still 100
        vote = p.after_round({"comm_goodput_bps": g, "send_bps": {"b": 8e6}})
    assert p.reference == 100 and vote["vote"] is False
    for g in (40, 40):
        vote = p.after_round({"comm_goodput_bps": g, "send_bps": {"b": 1e6, "c": 1e6}})
    assert vote["vote"] is True and vote["send_bps"] == {"b": 1000000, "c": 1000000}
    slow = {m: {"vote": True, "send_bps": {"a": 8e6}} for m in MEMBERS}  # the leaves' sends to the root: fast
    slow["a"] = vote  # a's sends to b and c are slow: a star rooted at a, b or c, the ring, the tree all use one
    action = p.decide(9, slow)
    assert action["strategy"] == "star:d" and "4 of 4" in action["reason"]
    p.view.strategy = "star:d"
    assert p.decide(10, slow) is None  # cooling down
    assert p.reference is None and p.goodputs == []  # a new reference under the new strategy


def test_robust_mode_without_a_drop_never_switches():
    p = AdaptiveStrategy({}, view("ring"))
    rng = np.random.default_rng(1)
    for r in range(1, 51):
        vote = p.after_round({"comm_goodput_bps": float(rng.normal(1e6, 5e4))})
        assert p.decide(r + 1, {m: vote for m in MEMBERS}) is None


def test_adaptive_batch_grows_at_most_twice_never_shrinks_and_stays_under_its_cap():
    p = AdaptiveBatch({"max_batch": 200, "ema": 1.0}, view(batch=32))
    sizes = []
    for gns in (1000, 1000, 1000, 10, 1000):
        action = p.decide(len(sizes) + 2, {m: {"gns": gns} for m in MEMBERS})
        if action:
            p.view.batch_size = action["batch_size"]
        sizes.append(p.view.batch_size)
    assert sizes == [64, 128, 200, 200, 200]
    assert p.decide(9, {"a": None}) is None


def test_votes_and_actions_are_checked():
    with pytest.raises(PolicyError, match="plain JSON"):
        check_vote({"x": float("nan")}, "p")
    with pytest.raises(PolicyError, match="more than 4096"):
        check_vote({"x": "y" * 5000}, "p")
    with pytest.raises(PolicyError, match="an action is an object of strategy, batch_size, members"):
        check_action({"peers": ["a"]}, "p")
    with pytest.raises(PolicyError, match="batch_size must be a whole number"):
        check_action({"batch_size": 0}, "p")


def test_the_noise_scale_of_gradients_with_a_known_one_is_found_within_ten_percent():
    rng = np.random.default_rng(0)
    dim, sigma = 2000, 1.0
    g = rng.normal(size=dim) * 0.05
    true = dim * sigma ** 2 / float(g @ g)  # tr(covariance) / |G|^2
    for b_small, n in ((32, 4), (300, 8)):
        est = NoiseScale(ema=None)
        for _ in range(200):
            small = g + rng.normal(size=dim) * sigma / np.sqrt(b_small)
            big = g + rng.normal(size=dim) * sigma / np.sqrt(b_small * n)
            value = est.update([small], [big], b_small, b_small * n)
        assert abs(value / true - 1) < 0.10, (b_small, value, true)
    assert NoiseScale().update([np.ones(3)], [np.ones(3)], 4, 4) is None  # no big batch: nothing to tell
    assert grad_var([np.array([1.0, 3.0])], [np.array([0.0, 1.0])]) == pytest.approx(2.5)


def test_a_member_that_decided_another_structure_refuses_the_formation(tmp_path):
    net = MemoryNetwork()
    conf = {"sync": 1, "epoch": 0, "ring": ["r0", "r1"], "strategy": "star:r0"}
    role = role_of(RingRole, tmp_path, net, "r0", conf, ["r0", "r1"])
    formation = Formation(1, 1, ["r0", "r1"], "star:r1", {}, "0" * 16)
    role.membership.adopt(formation)
    with pytest.raises(StrategyRefused, match="this node decided star:r0"):
        role.install(formation, behind=False)
    assert events_of(role, "strategy_refused")[0]["formation_strategy"] == "star:r1"
    formation.digest = formation.structure.digest()
    role.install(formation, behind=True)
    assert role.strategy == "star:r1"


class SwitchAtThree(Policy):
    """Votes its round; at round 3 the members move to a binary tree."""

    def after_round(self, metrics: dict[str, Any]) -> dict[str, Any]:
        return {"round": metrics["round"]}

    def decide(self, round_no: int, votes: dict[str, Any]) -> dict[str, Any] | None:
        if round_no == 3:
            return {"strategy": "binary_tree", "reason": f"round 3, votes of {len(votes)}"}
        return None


def test_ring_members_decide_together_and_switch_at_the_same_round(tmp_path, monkeypatch):
    from dml_app.policies import builtin
    monkeypatch.setitem(builtin.KINDS, "switch_at_three", SwitchAtThree)
    net = MemoryNetwork()
    names = ["r0", "r1", "r2", "r3"]
    conf = {"sync": 4, "epoch": 1, "ring": names, "join_wait_s": 5, "step_timeout_s": 10, "strategy": "star:r1",
            "policies": [{"kind": "switch_at_three"}, {"kind": "adaptive_batch", "max_batch": 64}]}
    roles = [role_of(RingRole, tmp_path, net, n, conf, names, seed=i) for i, n in enumerate(names)]
    run_all(roles)
    held = [r.ctx.model.get_weights() for r in roles]
    assert all(np.array_equal(a, b) for other in held[1:] for a, b in zip(held[0], other))
    for r in roles:
        rounds = events_of(r, "round")
        assert [e["strategy"] for e in rounds] == ["star:r1", "star:r1", "binary_tree", "binary_tree"]
        changed = events_of(r, "strategy_changed")
        assert [(e["round"], e["previous"], e["strategy"]) for e in changed] == [(3, "star:r1", "binary_tree")]
        assert "votes of 4" in changed[0]["reason"]
        decisions = [e for e in events_of(r, "policy_decision") if e["policy"] == "0:SwitchAtThree"]
        assert [d["round"] for d in decisions] == [3] and set(decisions[0]["votes"]) == set(names)
        sizes = [e["batch_size"] for e in rounds]
        assert sizes == sorted(sizes) and max(sizes) <= 64


def test_elastic_scaling_adds_while_the_gain_is_at_least_alpha_over_n_then_removes_the_last():
    from dml_app.policies.builtin import ElasticScaling
    v = PolicyView("agg", "fl_aggregator", ["t1"], None, 32, standby=["t2", "t3", "t4", "t5"])
    p = ElasticScaling({"window_rounds": 2, "alpha": 1 / 3}, v)
    throughput = {1: 100.0, 2: 180.0, 3: 230.0, 4: 240.0}  # gains +80 % (>= 1/6), +28 % (>= 1/9), +4.3 % (< 1/12)
    decisions = []
    for r in range(2, 20):
        action = p.decide(r, {"agg": {"throughput_sps": throughput[len(v.members)]}})
        if action:
            decisions.append((r, action["members"]))
            v.members = action["members"]
    assert decisions == [(3, ["t1", "t2"]), (5, ["t1", "t2", "t3"]), (7, ["t1", "t2", "t3", "t4"]),
                         (9, ["t1", "t2", "t3"])]
    assert p.stopped and p.history == [(1, 100.0), (2, 180.0), (3, 230.0), (4, 240.0)]


def test_an_aggregator_picks_its_standby_trainers_only_once_a_policy_adds_them(tmp_path, monkeypatch):
    from dml_app.policies import builtin
    from dml_app.roles.fl import AggregatorRole, TrainerRole

    class AddAtTwo(Policy):
        def after_round(self, metrics):
            return {"t": metrics.get("throughput_sps")}

        def decide(self, round_no, votes):
            return {"members": [*self.view.members, "t3"]} if round_no == 2 else None

    monkeypatch.setitem(builtin.KINDS, "add_at_two", AddAtTwo)
    net = MemoryNetwork()
    names = ["agg", "t1", "t2", "t3"]
    agg_conf = {"sync": 3, "trainers": names[1:], "deadline_s": 10, "standby": ["t2", "t3"],
                "trainer_samples": {"t1": 40, "t2": 40, "t3": 40}, "policies": [{"kind": "add_at_two"}]}
    roles = [role_of(AggregatorRole, tmp_path, net, "agg", agg_conf, names)]
    roles += [role_of(TrainerRole, tmp_path, net, t, {"sync": 3, "epoch": 1, "aggregator": "agg"}, names)
              for t in names[1:]]
    run_all(roles)
    rounds = events_of(roles[0], "round")
    assert [sorted(e["picked"]) for e in rounds] == [["t1"], ["t1", "t3"], ["t1", "t3"]]
    assert [e["cluster_size"] for e in rounds] == [1, 2, 2] and all(e["throughput_sps"] > 0 for e in rounds)
    assert "resize_latency_s" not in rounds[0] and 0 <= rounds[1]["resize_latency_s"] < 3
    changed = events_of(roles[0], "trainers_changed")
    assert [(e["added"], e["removed"], e["members"]) for e in changed] == [(["t3"], [], ["t1", "t3"])]
    assert events_of(roles[2], "round") == []  # t2 stood by the whole run


@pytest.mark.parametrize("votes,words", [
    ({"0:p": {"x": float("inf")}}, "r1's vote of 0:p: a vote must be plain JSON"),
    ({"0:p": ["yes"]}, "r1's vote of 0:p: a vote is a JSON object or None"),
    ({f"{i}:p": None for i in range(9)}, "r1's votes: an object of at most 8"),
    ("yes", "r1's votes: an object of at most 8")])
def test_a_join_with_bad_votes_is_answered_400_and_held_nowhere(tmp_path, votes, words):
    import json

    from dml_app.runtime.http import HttpError, Request
    net = MemoryNetwork()
    role = role_of(RingRole, tmp_path, net, "r0", {"sync": 1, "ring": ["r0", "r1"]}, ["r0", "r1"])
    body = json.dumps({"want": 1, "epoch": 0, "votes": votes}).replace("Infinity", "1e999").encode()
    with pytest.raises(HttpError) as refused:
        role.on_join(Request("POST", "/ring/join", {}, body, "application/json", sender="r1"))
    assert refused.value.status == 400 and words in refused.value.detail and role.membership._joins == {}


def test_robust_mode_tries_the_start_again_and_stays_when_it_is_good_or_returns_when_not():
    for back_good in (True, False):
        v = view("star:a")
        p = AdaptiveStrategy({"reference_rounds": 2, "window_rounds": 1, "cooldown_rounds": 2, "probe_rounds": 4}, v)
        for g in (100, 100):
            p.after_round({"comm_goodput_bps": g})
        assert p.home_reference == 100
        low = p.after_round({"comm_goodput_bps": 10, "send_bps": {"b": 1e6}})
        fast = {"vote": True, "send_bps": {"a": 8e6}}
        action = p.decide(4, {"a": low, "b": fast, "c": fast, "d": fast})
        assert action["strategy"] == "star:c"  # the first star whose root a reaches by an edge not seen slow
        v.strategy = "star:c"
        for r in range(5, 8):  # cooling down, then measuring anew: no switch before the probe
            assert p.decide(r, {m: p.after_round({"comm_goodput_bps": 90}) for m in MEMBERS}) is None
        probe = p.decide(8, {m: None for m in MEMBERS})
        assert probe == {"strategy": "star:a", "reason": "trying the start's strategy again after 4 rounds"}
        v.strategy = "star:a"
        vote = p.after_round({"comm_goodput_bps": 95 if back_good else 30})
        assert vote["vote"] is (not back_good)
        after = p.decide(9, {m: vote for m in MEMBERS})
        if back_good:
            assert after is None and p.reference == 100 and p.probing is None
        else:
            assert after["strategy"] == "star:c" and "still saw its goodput low" in after["reason"]


def test_a_policy_that_raises_or_a_vote_out_of_range_changes_nothing_and_is_an_event(tmp_path):
    from dml_app.policies.runner import Policies
    from dml_app.runtime.events import EventLog, read_events

    class Broken(Policy):
        def decide(self, round_no, votes):
            return {"strategy": votes["b"]["x"]}  # a peer's odd vote makes it raise

    events = EventLog(str(tmp_path / "e.jsonl"), "run", "a")
    applied = []
    group = Policies([Broken({}, view()), AdaptiveBatch({"ema": 1.0}, view())], events, applied.append)
    taken = group.decide(3, {"a": {"1:adaptive_batch": {"gns": 200.0}}, "b": {"0:Broken": {"y": 1}}}, MEMBERS)
    assert taken == applied == [{"batch_size": 64, "reason": "noise scale 200.0"}]
    kinds = [(e["type"], e.get("policy")) for e in read_events(events.path)]
    assert kinds == [("policy_error", "0:Broken"), ("policy_decision", "1:adaptive_batch")]
    assert group.take_recent()[0]["action"]["batch_size"] == 64 and group.take_recent() == []
    with pytest.raises(PolicyError, match="numbers must be below"):
        check_vote({"gns": 10 ** 400}, "p")
    with pytest.raises(PolicyError, match="not one of the ring's nodes"):
        check_action({"strategy": "star:zz"}, "p", MEMBERS)


def test_an_aborted_formation_undoes_its_rounds_decisions(tmp_path):
    net = MemoryNetwork()
    conf = {"sync": 3, "ring": ["r0", "r1"], "policies": [{"kind": "adaptive_batch", "ema": 1.0}]}
    role = role_of(RingRole, tmp_path, net, "r0", conf, ["r0", "r1"])
    votes = {"r0": {"0:adaptive_batch": {"gns": 500.0}}, "r1": {"0:adaptive_batch": {"gns": 500.0}}}
    formation = Formation(4, 2, ["r0", "r1"], "ring", votes)
    role._decide(formation)
    role._decide(formation)  # once a round
    assert role.batch_size == 32 and role.policies.policies[0].average == 500.0  # (the shard conf's batch: 16)
    role.undo(formation)
    assert role.batch_size == role.view.batch_size == 16 and role.policies.policies[0].average is None
    role._decide(Formation(5, 2, ["r0", "r1"], "ring", votes))  # the round formed again: decided again
    assert role.batch_size == 32 and len(events_of(role, "policy_decision")) == 2
