"""cgroup writes as tables for v1 and v2, and both made real in fake trees under tmp_path."""
import os

import pytest

from worker.api.errors import CapabilityError, NodeRuntimeError
from worker.confinement.cgroups import CFS_PERIOD_US, Cgroups, detect_version, limit_writes
from worker.confinement.confine import DEFAULT_PIDS_MAX, default_mem_bytes

MIB = 2**20


@pytest.mark.parametrize("cpu,mem,writes", [
    (0.5, None, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "50000")]),
    (None, None, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "-1")]),
    (2, None, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "200000")]),
    (0.333, None, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "33300")]),
    (None, 64 * MIB, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "-1"),
                      ("memory", "memory.limit_in_bytes", "67108864"),
                      ("memory", "memory.memsw.limit_in_bytes", "67108864")]),
    (0.5, 64 * MIB, [("cpu", "cpu.cfs_period_us", "100000"), ("cpu", "cpu.cfs_quota_us", "50000"),
                     ("memory", "memory.limit_in_bytes", "67108864"),
                     ("memory", "memory.memsw.limit_in_bytes", "67108864")]),
])
def test_limit_writes_v1(cpu, mem, writes):
    assert limit_writes(1, cpu, mem) == writes
    assert limit_writes(1, cpu, mem, 100) == writes + [("pids", "pids.max", "100")]


@pytest.mark.parametrize("cpu,mem,writes", [
    (0.5, None, [("", "cpu.max", "50000 100000"), ("", "memory.max", "max")]),
    (None, None, [("", "cpu.max", "max 100000"), ("", "memory.max", "max")]),
    (1.5, None, [("", "cpu.max", "150000 100000"), ("", "memory.max", "max")]),
    (None, 64 * MIB, [("", "cpu.max", "max 100000"), ("", "memory.max", "67108864"),
                      ("", "memory.swap.max", "0")]),
    (0.5, 2**30, [("", "cpu.max", "50000 100000"), ("", "memory.max", "1073741824"),
                  ("", "memory.swap.max", "0")]),
])
def test_limit_writes_v2(cpu, mem, writes):
    assert limit_writes(2, cpu, mem) == writes
    assert limit_writes(2, cpu, mem, 100) == writes + [("", "pids.max", "100")]


def test_period_constant():
    assert CFS_PERIOD_US == 100_000


# --- detect_version -----------------------------------------------------------------------------

@pytest.mark.parametrize("dirs,files,version", [
    ([], [], None),
    (["cpu"], [], None),
    (["memory"], [], None),
    (["cpu", "memory"], [], 1),
    (["cpu", "memory", "pids", "unified"], [], 1),
    ([], ["cgroup.controllers"], 2),
    (["cpu", "memory"], ["cgroup.controllers"], 2),
    ([], ["cpu", "memory"], None),  # files, not hierarchies
])
def test_detect_version(tmp_path, dirs, files, version):
    for d in dirs:
        (tmp_path / d).mkdir()
    for f in files:
        (tmp_path / f).write_text("cpu memory\n")
    assert detect_version(str(tmp_path)) == version


def test_missing_root(tmp_path):
    assert detect_version(str(tmp_path / "absent")) is None
    groups = Cgroups("edgetb-x", str(tmp_path / "absent"))
    assert groups.version is None and groups.dirs("n1") == [] and groups.pids("n1") == set()
    with pytest.raises(CapabilityError, match="no cgroup"):
        groups.create("n1", 0.5, None)


# --- fake trees ---------------------------------------------------------------------------------

V1_CPU_FILES = ("cgroup.procs", "cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.shares")
V1_MEM_FILES = ("cgroup.procs", "memory.limit_in_bytes", "memory.memsw.limit_in_bytes")
V1_PIDS_FILES = ("cgroup.procs", "pids.max")
V2_FILES = ("cgroup.procs", "cgroup.controllers", "cgroup.subtree_control", "cpu.max", "memory.max",
            "memory.swap.max")


def make_files(directory, names):
    directory.mkdir(parents=True, exist_ok=True)
    for name in names:
        (directory / name).write_text("")


def v1_tree(root, group=None, node=None):
    """A v1 layout as the kernel shows it: one hierarchy per controller, files in every group."""
    make_files(root / "cpu", V1_CPU_FILES)
    make_files(root / "memory", V1_MEM_FILES)
    make_files(root / "pids", V1_PIDS_FILES)
    if group and node:
        make_files(root / "cpu" / group / node, V1_CPU_FILES)
        make_files(root / "memory" / group / node, V1_MEM_FILES)
        make_files(root / "pids" / group / node, V1_PIDS_FILES)


def v2_tree(root, group=None, node=None):
    make_files(root, V2_FILES)
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    if group and node:
        make_files(root / group, V2_FILES)
        make_files(root / group / node, V2_FILES)


@pytest.mark.parametrize("prebuilt", [False, True])
def test_v1_create(tmp_path, prebuilt):
    v1_tree(tmp_path, *(("edgetb-x", "n1") if prebuilt else ()))
    groups = Cgroups("edgetb-x", str(tmp_path))
    assert groups.version == 1
    groups.create("n1", 0.5, 64 * MIB)
    cpu, mem = tmp_path / "cpu/edgetb-x/n1", tmp_path / "memory/edgetb-x/n1"
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "50000"
    assert (mem / "memory.limit_in_bytes").read_text() == str(64 * MIB)
    assert (mem / "memory.memsw.limit_in_bytes").read_text() == str(64 * MIB)
    pids = tmp_path / "pids/edgetb-x/n1"  # the pids hierarchy is mounted: the default limit
    assert (pids / "pids.max").read_text() == str(DEFAULT_PIDS_MAX)
    assert not (tmp_path / "freezer").exists()  # (not mounted in this tree: not joined)
    assert not (tmp_path / "edgetb-x").exists()  # nothing v2-shaped in a v1 tree
    assert groups.dirs("n1") == [str(cpu), str(mem), str(pids)]
    assert groups.procs_files("n1") == [str(cpu / "cgroup.procs"), str(mem / "cgroup.procs"),
                                        str(pids / "cgroup.procs")]
    assert groups.nodes() == {"n1"}
    assert groups.freezer_dir("n1") is None
    (tmp_path / "freezer").mkdir()
    groups.create("n1", 0.5, 64 * MIB, 50)
    assert (pids / "pids.max").read_text() == "50"
    assert groups.freezer_dir("n1") == str(tmp_path / "freezer/edgetb-x/n1")
    assert os.path.isdir(groups.freezer_dir("n1"))


def test_v1_create_without_limits_sets_the_defaults(tmp_path):
    v1_tree(tmp_path, "edgetb-x", "n1")
    Cgroups("edgetb-x", str(tmp_path)).create("n1", None, None)
    assert (tmp_path / "cpu/edgetb-x/n1/cpu.cfs_quota_us").read_text() == "-1"
    assert (tmp_path / "memory/edgetb-x/n1/memory.limit_in_bytes").read_text() == str(default_mem_bytes())
    assert (tmp_path / "pids/edgetb-x/n1/pids.max").read_text() == str(DEFAULT_PIDS_MAX)


def test_v1_create_is_idempotent_and_updates(tmp_path):
    v1_tree(tmp_path)
    groups = Cgroups("edgetb-x", str(tmp_path))
    groups.create("n1", 0.5, None)
    groups.create("n1", 0.25, None)
    groups.create("n2", None, None)
    assert (tmp_path / "cpu/edgetb-x/n1/cpu.cfs_quota_us").read_text() == "25000"
    assert (tmp_path / "cpu/edgetb-x/n2/cpu.cfs_quota_us").read_text() == "-1"
    assert groups.nodes() == {"n1", "n2"}


@pytest.mark.parametrize("prebuilt", [False, True])
def test_v2_create(tmp_path, prebuilt):
    v2_tree(tmp_path, *(("edgetb-y", "n2") if prebuilt else ()))
    groups = Cgroups("edgetb-y", str(tmp_path))
    assert groups.version == 2
    groups.create("n2", 0.5, 64 * MIB)
    base = tmp_path / "edgetb-y"
    node = base / "n2"
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (base / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (node / "cpu.max").read_text() == "50000 100000"
    assert (node / "memory.max").read_text() == str(64 * MIB)
    assert (node / "memory.swap.max").read_text() == "0"
    assert (node / "pids.max").read_text() == str(DEFAULT_PIDS_MAX)
    assert groups.freezer_dir("n2") == str(node)
    assert not (tmp_path / "cpu").exists() and not (tmp_path / "memory").exists()
    assert groups.dirs("n2") == [str(node)]
    assert groups.procs_files("n2") == [str(node / "cgroup.procs")]
    assert groups.nodes() == {"n2"}


def test_v2_create_without_limits_sets_the_defaults(tmp_path):
    v2_tree(tmp_path, "edgetb-y", "n2")
    Cgroups("edgetb-y", str(tmp_path)).create("n2", None, None)
    node = tmp_path / "edgetb-y/n2"
    assert (node / "cpu.max").read_text() == "max 100000"
    assert (node / "memory.max").read_text() == str(default_mem_bytes())
    assert (node / "memory.swap.max").read_text() == "0"
    assert (node / "pids.max").read_text() == str(DEFAULT_PIDS_MAX)


@pytest.mark.parametrize("tree", [v1_tree, v2_tree])
def test_pids_reads_cgroup_procs(tmp_path, tree):
    tree(tmp_path, "edgetb-z", "n1")
    groups = Cgroups("edgetb-z", str(tmp_path))
    assert groups.pids("n1") == set()
    files = groups.procs_files("n1")
    with open(files[0], "w") as f:
        f.write("12\n34\n")
    if len(files) > 1:  # v1: the union over the hierarchies
        with open(files[1], "w") as f:
            f.write("34\n56\n")
    assert groups.pids("n1") == ({12, 34, 56} if len(files) > 1 else {12, 34})
    assert groups.pids("absent") == set()


def test_nodes_ignores_files(tmp_path):
    v2_tree(tmp_path, "edgetb-y", "n2")
    groups = Cgroups("edgetb-y", str(tmp_path))
    assert os.path.isfile(tmp_path / "edgetb-y" / "cpu.max")
    assert groups.nodes() == {"n2"}


def cgroupfs_open(real_open=open):
    """open() as on cgroupfs: a file the kernel did not make cannot be created (EACCES, not ENOENT)."""
    def fake(path, mode="r", *args, **kwargs):
        if "w" in mode and not os.path.exists(path):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, mode, *args, **kwargs)
    return fake


def test_required_limit_file_missing_is_an_error(tmp_path, monkeypatch):
    v1_tree(tmp_path, "edgetb-x", "n1")
    (tmp_path / "cpu/edgetb-x/n1/cpu.cfs_quota_us").unlink()
    monkeypatch.setattr("worker.confinement.cgroups.open", cgroupfs_open(), raising=False)
    with pytest.raises(NodeRuntimeError, match="cpu.cfs_quota_us"):
        Cgroups("edgetb-x", str(tmp_path)).create("n1", 0.5, None)


def test_missing_swap_accounting_file_is_skipped(tmp_path, monkeypatch):
    v1_tree(tmp_path, "edgetb-x", "n1")
    (tmp_path / "memory/edgetb-x/n1/memory.memsw.limit_in_bytes").unlink()
    monkeypatch.setattr("worker.confinement.cgroups.open", cgroupfs_open(), raising=False)
    Cgroups("edgetb-x", str(tmp_path)).create("n1", 0.5, 64 * MIB)
    assert (tmp_path / "memory/edgetb-x/n1/memory.limit_in_bytes").read_text() == str(64 * MIB)


def test_a_containers_counter_groups_from_its_proc_cgroup(tmp_path):
    from worker.confinement.cgroups import groups_of

    for d in ("cpu,cpuacct", "memory", "unified"):
        (tmp_path / d).mkdir()
    v1 = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n0::/\n"
    assert groups_of(v1, str(tmp_path)) == (1, [str(tmp_path / "cpu,cpuacct" / "docker/abc"),
                                                str(tmp_path / "memory" / "docker/abc")])
    (tmp_path / "cpuacct").mkdir()  # a mount of its own (or the usual link to cpu,cpuacct) comes first
    assert groups_of(v1, str(tmp_path))[1][0] == str(tmp_path / "cpuacct" / "docker/abc")
    v2 = "0::/system.slice/docker-abc.scope\n"
    assert groups_of(v2, str(tmp_path)) == (2, [str(tmp_path / "system.slice/docker-abc.scope")])
    assert groups_of("", str(tmp_path)) == (None, [])
