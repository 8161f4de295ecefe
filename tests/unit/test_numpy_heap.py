"""The numpy nets' training keeps freed memory for its next batches and gives it back after:
page faults and resident memory of this very process, measured."""
from __future__ import annotations

import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dml_app.models.numpy import heap
from dml_app.models.numpy import net as numpy_net
from dml_app.models.numpy.net import build_numpy

pytestmark = pytest.mark.skipif(heap._LIBC is None, reason="not glibc: reuse_freed_memory does nothing")

ROOT = Path(__file__).resolve().parents[2]
CHUNK_FLOATS = 2**17  # 1 MiB of float64: above glibc's default mmap threshold, below THP's 2 MiB pages
CHUNKS = 16


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _churn() -> int:
    """Page faults of allocating, filling and freeing 16 arrays of 1 MiB one after the other."""
    before = _faults()
    for _ in range(CHUNKS):
        a = np.empty(CHUNK_FLOATS)
        a.fill(1.0)
        del a
    return _faults() - before


def test_freed_memory_is_reused_inside_and_given_back_on_leaving():
    pages = CHUNK_FLOATS * 8 // resource.getpagesize()
    with heap.reuse_freed_memory():
        _churn()  # the heap grows (at most) once
        inside = _churn()
        with heap.reuse_freed_memory():  # nested (two trainings in one process): still kept
            pass
        assert _churn() < pages
        held = np.ones(64 * CHUNK_FLOATS)  # 64 MiB, then freed: kept inside (it is above 32 MiB's
        held[:] = 2.0                      # threshold: its own mapping, freed at once)
        del held
        held = np.ones(24 * CHUNK_FLOATS)  # 24 MiB from the heap, then freed: kept inside
        del held
        resident_inside = _resident_mib()
    resident_after = _resident_mib()
    assert inside < pages, (inside, pages)  # 16 arrays of 1 MiB: less than one array's fresh pages
    assert resident_inside - resident_after >= 16, (resident_inside, resident_after)  # given back


def _given_back(timeout_s: float = 10.0) -> bool:
    """Wait until a delayed release has given the kept memory back; whether it did."""
    deadline = time.monotonic() + timeout_s
    while heap._kept and time.monotonic() < deadline:
        time.sleep(0.05)
    return not heap._kept


def test_a_cnns_training_faults_less_per_batch_than_it_did_and_ends_with_memory_given_back(monkeypatch):
    monkeypatch.setattr(numpy_net, "KEEP_FREED_S", 0.0)  # given back as each call ends
    rng = np.random.default_rng(0)
    x, y = rng.random((320, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 320)
    net = build_numpy("edgetb_fashion_cnn", (28, 28, 1), 10, {"seed": 0})
    net.train(x[:32], y[:32])
    before = _faults()
    net.train(x, y, batch_size=32)  # 10 batches: only the first touches fresh pages
    faults = _faults() - before
    before = _faults()
    net.train(x[:32], y[:32])  # one batch: all fresh pages
    one_batch = _faults() - before
    assert faults < 3 * one_batch, (faults, one_batch)


def _a_rounds_faults() -> str:
    """Page faults of an evaluation right after training and of one after the delay, and the
    resident MiB given back by the delayed release: ``shared fresh freed_mib``."""
    rng = np.random.default_rng(0)
    x, y = rng.random((100, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 100)
    net = build_numpy("edgetb_fashion_cnn", (28, 28, 1), 10, {"seed": 0})
    net.train(x, y, batch_size=32)
    before = _faults()
    net.evaluate(x, y)  # right after training (as a round goes): its pages
    shared = _faults() - before
    resident_kept = _resident_mib()
    assert heap._kept and _given_back(numpy_net.KEEP_FREED_S + 10)
    resident_after = _resident_mib()
    before = _faults()
    net.evaluate(x, y)  # after the delay: fresh pages
    fresh = _faults() - before
    assert _given_back(numpy_net.KEEP_FREED_S + 10)
    return f"{shared} {fresh} {resident_kept - resident_after:.1f}"


def test_a_rounds_calls_share_freed_memory_given_back_once_the_delay_has_passed():
    # In a process of its own: what the heap already holds (the tests before, in this one) would
    # serve the "fresh" evaluation from pages it kept.
    code = "from tests.unit.test_numpy_heap import _a_rounds_faults as f; print(f())"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shared, fresh, freed_mib = out.stdout.split()
    assert int(shared) * 4 < int(fresh), (shared, fresh)  # (about a tenth, measured)
    assert float(freed_mib) >= 8, freed_mib
