"""cgroup writes as tables for v1 and v2, and both made real in fake trees."""
import os

import pytest

from worker.cgroups import Cgroups, detect_version, limit_writes


@pytest.mark.parametrize("version,cpu,mem,writes", [
    (1, 0.5, None, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "50000")]),
    (1, None, 64 * 2**20, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "-1"),
                           ("memory", "memory.limit_in_bytes", "67108864"),
                           ("memory", "memory.memsw.limit_in_bytes", "67108864")]),
    (2, 1.5, None, [("", "cpu.max", "150000 100000"), ("", "memory.max", "max")]),
    (2, None, 2**30, [("", "cpu.max", "max 100000"), ("", "memory.max", "1073741824"), ("", "memory.swap.max", "0")]),
])
def test_limit_writes(version, cpu, mem, writes):
    assert limit_writes(version, cpu, mem) == writes


def test_detect_version(tmp_path):
    assert detect_version(str(tmp_path)) is None
    (tmp_path / "cpu").mkdir()
    (tmp_path / "memory").mkdir()
    assert detect_version(str(tmp_path)) == 1
    (tmp_path / "cgroup.controllers").write_text("cpu memory")
    assert detect_version(str(tmp_path)) == 2


def test_v1_tree(tmp_path):
    for c in ("cpu", "memory"):
        (tmp_path / c).mkdir()
    groups = Cgroups("edgetb-x", str(tmp_path))
    groups.create("n1", 0.25, 32 * 2**20)
    assert (tmp_path / "cpu/edgetb-x/n1/cpu.cfs_quota_us").read_text() == "25000"
    assert (tmp_path / "memory/edgetb-x/n1/memory.limit_in_bytes").read_text() == str(32 * 2**20)
    (tmp_path / "cpu/edgetb-x/n1/cgroup.procs").write_text("12\n34\n")
    assert groups.pids("n1") == {12, 34}
    assert groups.nodes() == {"n1"}


def test_v2_tree(tmp_path):
    (tmp_path / "cgroup.controllers").write_text("cpu memory")
    groups = Cgroups("edgetb-y", str(tmp_path))
    groups.create("n2", 2, 2**30)
    base = tmp_path / "edgetb-y"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert (base / "n2/cpu.max").read_text() == "200000 100000"
    assert (base / "n2/memory.max").read_text() == str(2**30)
    assert groups.procs_files("n2") == [os.path.join(str(base), "n2", "cgroup.procs")]
