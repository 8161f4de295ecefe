"""The guest is what the vm tier claims: a stock kernel with sch_netem and cgroup v2 only."""
import os

from worker.confinement.cgroups import detect_version
from worker.shaping.apply import netem_available


def test_guest_kernel_has_netem_and_a_unified_cgroup_hierarchy():
    assert netem_available(), f"{os.uname().release} has no sch_netem"
    assert detect_version() == 2
    with open("/proc/mounts") as f:
        kinds = {line.split()[2] for line in f}
    assert "cgroup" not in kinds, "a cgroup v1 hierarchy is mounted in the guest"
