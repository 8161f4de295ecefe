"""Elastic scaling end to end on netns nodes: an FL aggregator whose access downlink is shared
by its trainers' uploads, 6 standby trainers (0.5 core each) and the ``elastic_scaling`` policy.
The policy must stop within one trainer of where a fixed-N sweep of the same experiment (same
data windows, seeds and links) says more trainers stop paying (the last N with a gain of at
least alpha/N); membership.csv must show each add and the removal, and the first round after
each change must carry a resize latency under 3 s."""
from __future__ import annotations

import os
import statistics
import time

import pytest

from controller.model.units import parse_rate_bps
from tests.e2e.elastic import experiment as ex

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces, tc)")]
RESIZE_GOAL_S = 3.0
SWEEP_ROUNDS = 4  # the first is left out of T(N): 3 rounds' median


def sweep_until_it_stops_paying(run) -> tuple[dict[int, float], dict[int, int]]:
    """T(N) of fixed runs N = 1, 2, ... until the gain falls below alpha/N (or N = 6): what the
    last paying N needs. Also each run's upload size in bytes (the trainers' largest)."""
    t_by_n: dict[int, float] = {}
    upload_bytes: dict[int, int] = {}
    for n in range(1, len(ex.TRAINERS) + 1):
        r = ex.start(run, n, rounds=SWEEP_ROUNDS)
        result = ex.finish(r)
        r.close()
        assert len(result.rounds) == SWEEP_ROUNDS and all(e["closed"] == "all" for e in result.rounds), result.rounds
        assert all(e["cluster_size"] == n and len(e["picked"]) == n for e in result.rounds), result.rounds
        t_by_n[n] = result.throughput_sps()
        upload_bytes[n] = max(max(e["recv_from"].values()) for e in result.rounds)
        if ex.last_paying(t_by_n) < n:
            break
    return t_by_n, upload_bytes


def test_elastic_scaling_stops_where_a_fixed_sweep_stops_paying(run):
    started = time.monotonic()
    rounds = ex.elastic_rounds()
    r = ex.start(run, None, rounds=rounds)
    elastic = ex.finish(r)
    r.close()
    agg = elastic.rounds
    assert len(agg) == rounds and all(e["closed"] == "all" for e in agg), agg

    # membership.csv: t2, t3, ... added one at a time, every window, then the last one removed
    changes = elastic.changes
    assert len(changes) >= 2, changes
    *adds, removal = changes
    assert [c["detail"]["added"] for c in adds] == [[t] for t in ex.TRAINERS[1:len(adds) + 1]], adds
    assert all(c["detail"]["removed"] == [] for c in adds), adds
    assert (removal["detail"]["added"], removal["detail"]["removed"], removal["detail"]["members"]) == \
        ([], adds[-1]["detail"]["added"], ex.TRAINERS[:len(adds)]), removal
    assert "below alpha/N" in removal["detail"]["reason"], removal
    stop_n = len(adds)
    decisions = elastic.decisions
    assert [d["action"]["members"] for d in decisions] == [c["detail"]["members"] for c in changes], decisions

    # each change takes effect with the next round, which records how long after the decision it began
    members = ex.TRAINERS[:1]
    latencies_s = []
    for change in changes:
        at = float(change["t"])
        before = [e for e in agg if e["t_start"] < at]
        first = next(e for e in agg if e["t_start"] >= at)
        assert sorted(before[-1]["picked"]) == members, (before[-1], change)
        members = change["detail"]["members"]
        assert sorted(first["picked"]) == members and first["cluster_size"] == len(members), (first, change)
        latency_s = first["resize_latency_s"]
        assert 0 <= latency_s < RESIZE_GOAL_S and abs(latency_s - (first["t_start"] - at)) < 0.05, (latency_s, first)
        latencies_s.append(latency_s)
    assert sum("resize_latency_s" in e for e in agg) == len(changes), agg
    assert elastic.final_size() == stop_n and all(e["cluster_size"] == stop_n for e in agg[-3:]), agg[-3:]
    # a window per trainer count: the changes come every window_rounds rounds
    firsts = [next(e["round"] for e in agg if e["t_start"] >= float(c["t"])) for c in changes]
    assert firsts == [1 + ex.WINDOW_ROUNDS * (i + 1) for i in range(len(changes))], firsts

    # the sweep: fixed N, no policy
    t_by_n, upload_bytes = sweep_until_it_stops_paying(run)
    last = ex.last_paying(t_by_n)
    report = (f"T(N) {({n: round(t) for n, t in t_by_n.items()})}, gains "
              f"{({n: round(g, 3) for n, g in ex.gains(t_by_n).items()})}, sweep's last paying N {last}, "
              f"policy stopped at {stop_n}, resize latencies {', '.join(f'{s * 1e3:.2f}' for s in latencies_s)} ms, "
              f"{time.monotonic() - started:.0f} s")
    print(report)
    assert abs(stop_n - last) <= 1, report
    assert 3 <= last <= 4, f"the downlink should saturate at 3-4 trainers: {report}"

    # by hand: a trainer's upload alone at its link's rate, N uploads at most the downlink's
    samples = ex.SAMPLES_PER_TRAINER
    uplink_bps, downlink_bps = parse_rate_bps(ex.UPLINK), parse_rate_bps(ex.DOWNLINK)
    for n, t in t_by_n.items():
        bits = upload_bytes[n] * 8
        bound = samples * min(n * uplink_bps, downlink_bps) / bits
        assert t <= 1.02 * bound, (n, t, bound)
        assert t >= 0.75 * bound, (n, t, bound)  # the links, not the training, make the round
    # the policy measured the same curve as the sweep (where it has two rounds or more of a size: one
    # round alone was seen 18 % off the sweep's median under CI's load)
    by_size = elastic.throughput_by_size(skip_first=1)
    compared = sorted(n for n in set(by_size) & set(t_by_n) if len(by_size[n]) >= 2)
    assert len(compared) >= 2, (by_size, t_by_n)
    for n in compared:
        assert abs(statistics.median(by_size[n]) / t_by_n[n] - 1) < 0.15, (n, by_size, t_by_n)
