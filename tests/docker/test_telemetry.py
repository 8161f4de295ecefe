"""Docker nodes in the telemetry: their CPU and memory series come from the container's groups."""
from __future__ import annotations

import time

from tests.docker.conftest import DOCKER
from tests.netns.conftest import report
from worker.observe.telemetry import MISSING, NODE_FIELDS, Sampler

pytestmark = DOCKER


def test_a_containers_cpu_and_memory_are_sampled(host, request):
    host.create_nodes({"version": 1, "nodes": [{"name": "busy", "cpu": 0.5}, {"name": "quiet"}]})
    proc = host.start_process("busy", {"version": 1, "argv": ["python3", "-c", "while True: pass"]})
    sampler = Sampler(host.store, None, 100)
    try:
        time.sleep(0.5)
        t0, _, _, first, _ = sampler.sample()
        time.sleep(3)
        t1, _, _, last, _ = sampler.sample()
    finally:
        host.stop_process("busy", proc["id"])
        sampler.stop()
    width = len(NODE_FIELDS)
    values = {name: (first[i * width:(i + 1) * width], last[i * width:(i + 1) * width])
              for i, name in enumerate(["busy", "quiet"])}
    (cpu0, mem0, *_), (cpu1, mem1, *_) = values["busy"]
    assert MISSING not in (cpu0, cpu1, mem0, mem1), values
    share = (cpu1 - cpu0) / 1e9 / (t1 - t0)
    report(request, "busy container's CPU share (cpu=0.5) from the sampler", share)
    assert 0.2 <= share <= 0.55, f"{share:.2f} cores for a busy loop under a 0.5-core quota"
    assert mem1 > 1_000_000  # a Python interpreter
    quiet_cpu = values["quiet"][1][0]
    assert quiet_cpu != MISSING and quiet_cpu < cpu1
