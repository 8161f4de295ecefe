"""Phase intervals of a round (dml_app/roles/phases.py): merging, waits, the cap."""
from __future__ import annotations

import threading
import time

from dml_app.roles.phases import Phases, merge


def test_merge_joins_overlaps_and_caps_by_closing_the_shortest_gaps():
    assert merge([[3, 4], [0, 1], [0.5, 2]]) == [[0, 2], [3, 4]]
    # with CPU clocks: the first start's and the last end's (overlaps are not counted twice)
    assert merge([[0, 1, 10, 10.5], [0.5, 2, 10.2, 11], [3, 4, 12, 12.5]]) == [[0, 2, 10, 11], [3, 4, 12, 12.5]]
    assert merge([[0, 1], [1.1, 2], [5, 6], [9, 10]], limit=2) == [[0, 2], [5, 10]] or \
        merge([[0, 1], [1.1, 2], [5, 6], [9, 10]], limit=2) == [[0, 6], [9, 10]]
    assert len(merge([[i, i + 0.5] for i in range(1000)], limit=10)) == 10


def test_take_gives_each_kind_and_the_waits_between_them_then_starts_afresh():
    p = Phases()
    t0 = time.time()
    with p.timed("train"):
        time.sleep(0.02)
    time.sleep(0.03)  # waiting for a peer
    with p.timed("send"):
        time.sleep(0.01)
    t1 = time.time() + 0.02
    got = p.take(t0, t1)
    assert len(got["train"]) == 1 and 0.015 < got["train"][0][1] - got["train"][0][0] < 0.1
    assert len(got["send"]) == 1 and got["evaluate"] == []
    waits = got["wait"]
    assert len(waits) == 2 and 0.025 < waits[0][1] - waits[0][0] < 0.1  # between train and send, and after send
    assert abs(waits[-1][1] - round(t1, 4)) < 1e-3
    total = sum(s[1] - s[0] for v in got.values() for s in v)
    assert abs(total - (t1 - t0)) < 0.01  # the four kinds tile the round
    assert p.take(t1, t1 + 1)["train"] == []


def test_parallel_sends_from_threads_are_merged():
    p = Phases()
    t0 = time.time()

    def send() -> None:
        with p.timed("send"):
            time.sleep(0.05)

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    got = p.take(t0, time.time())
    assert len(got["send"]) == 1


def test_each_phase_carries_the_process_cpu_clock_busy_work_counts_and_a_sleep_does_not():
    p = Phases()
    t0 = time.time()
    with p.timed("train"):
        end = time.process_time() + 0.05
        while time.process_time() < end:  # 50 ms of CPU
            pass
    with p.timed("send"):
        time.sleep(0.05)
    got = p.take(t0, time.time())
    (a, b, c0, c1), = got["train"]
    assert c1 - c0 >= 0.045 and c1 - c0 <= (b - a) + 0.01
    (a, b, c0, c1), = got["send"]
    assert b - a >= 0.045 and c1 - c0 < 0.02
    assert all(len(w) == 2 for w in got["wait"])  # waits have no clock
