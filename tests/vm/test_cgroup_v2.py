"""A node's cgroup v2 paths on Debian's stock kernel (a unified hierarchy, nothing on v1): the
limits in cpu.max and memory.max and what they hold, the counters telemetry reads (cpu.stat,
memory.current), the joins, pause and resume by cgroup.freeze with the limits kept, and
reset removing every group."""
import os
import sys
import time

from tests.netns.conftest import nodes_body, report
from worker.confinement.cgroups import detect_version

MIB = 1024 * 1024
ROOT = "/sys/fs/cgroup"
BURN = [sys.executable, "-c", "while True: pass"]


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def keyed(path: str) -> dict[str, int]:
    return {k: int(v) for k, v in (line.split() for line in read(path).splitlines())}


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share_of(pid: int, seconds: float) -> float:
    cpu0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_s(pid) - cpu0) / (time.monotonic() - t0)


def groups_of_testbed(host) -> list[str]:
    return sorted(e for e in os.listdir(ROOT) if e.startswith(f"edgetb-{host.testbed_id}"))


def test_cpu_limit_telemetry_pause_and_reset(host, request):
    assert detect_version() == 2
    host.create_nodes(nodes_body({"name": "busy", "cpu": 0.5, "mem_bytes": 256 * MIB}))
    group = host.runtime.cgroups.dirs("busy")[0]
    assert read(f"{group}/cpu.max") == "50000 100000"
    assert read(f"{group}/memory.max") == str(256 * MIB) and read(f"{group}/memory.swap.max") == "0"

    proc = host.start_process("busy", {"version": 1, "argv": BURN})
    pid = proc["pid"]
    assert pid in host.runtime.cgroups.pids("busy")
    assert read(f"/proc/{pid}/cgroup") == f"0::/{os.path.relpath(group, ROOT)}"
    time.sleep(0.5)

    reader = host.runtime.cgroups.reader("busy")
    cpu0_ns, stat0, t0 = reader.cpu_ns(), keyed(f"{group}/cpu.stat"), time.monotonic()
    share = share_of(pid, 3.0)
    cpu1_ns, stat1, elapsed = reader.cpu_ns(), keyed(f"{group}/cpu.stat"), time.monotonic() - t0
    mem = reader.mem_bytes()
    reader.close()
    report(request, "burner CPU share under cpu=0.5", share)
    assert 0.3 <= share <= 0.55, f"a busy loop used {share:.2f} of a core under cpu=0.5"
    assert stat1["nr_throttled"] > stat0["nr_throttled"]
    # telemetry's counters are the group's: cpu.stat's usage and memory.current
    group_share = (cpu1_ns - cpu0_ns) / 1e9 / elapsed
    assert abs(group_share - share) <= 0.05, (group_share, share)
    # read one after the other, while the burner runs: at most a few ms apart
    assert abs(cpu1_ns / 1000 - stat1["usage_usec"]) <= 20_000, (cpu1_ns, stat1)
    assert 1 * MIB < mem < 256 * MIB and abs(mem - int(read(f"{group}/memory.current"))) < 4 * MIB, mem

    # pause: cgroup.freeze; nothing runs; resume: it runs again, under its limit still
    host.fault({"version": 1, "faults": [{"kind": "freeze", "node": "busy"}]})
    frozen_dir = host.faults.freezer_dir("busy")[0]
    deadline = time.monotonic() + 5
    while keyed(f"{frozen_dir}/cgroup.events")["frozen"] != 1:
        assert time.monotonic() < deadline, "the node's group never reported frozen"
        time.sleep(0.05)
    assert share_of(pid, 1.0) < 0.02
    host.fault({"version": 1, "faults": [{"kind": "thaw", "node": "busy"}]})
    assert keyed(f"{frozen_dir}/cgroup.events")["frozen"] == 0
    assert pid in host.runtime.cgroups.pids("busy"), "pause and resume took the process out of its limits"
    share = share_of(pid, 2.0)
    report(request, "burner CPU share after resume", share)
    assert 0.3 <= share <= 0.55, f"after pause and resume the busy loop used {share:.2f} of a core under cpu=0.5"

    assert groups_of_testbed(host)
    host.reset()
    assert groups_of_testbed(host) == [], "reset left cgroups behind"
    assert not os.path.exists(f"/proc/{pid}") or read(f"/proc/{pid}/stat").split()[2] == "Z"


def test_memory_limit_kills_beyond_it_and_counts_the_kill(host):
    host.create_nodes(nodes_body({"name": "small", "mem_bytes": 64 * MIB}))
    group = host.runtime.cgroups.dirs("small")[0]
    big = host.exec("small", {"version": 1, "timeout_s": 120, "argv": [
        sys.executable, "-c", "b = bytearray(256 * 1024 * 1024); print('allocated')"]})
    assert "allocated" not in big["stdout"] and big["returncode"] in (-9, 137), big
    assert keyed(f"{group}/memory.events")["oom_kill"] >= 1
    assert int(read(f"{group}/memory.peak" if os.path.exists(f"{group}/memory.peak") else f"{group}/memory.max")) <= 64 * MIB
    small = host.exec("small", {"version": 1, "timeout_s": 120, "argv": [
        sys.executable, "-c", "b = bytearray(16 * 1024 * 1024); print('allocated')"]})
    assert small["returncode"] == 0 and "allocated" in small["stdout"], small
