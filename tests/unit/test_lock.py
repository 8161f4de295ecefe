"""The testbed lock: who holds an id, refusals naming the holder, stale and kept testbeds."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from controller.workers.lock import DirectoryLock, Holder, TestbedLock, check_testbed_id
from worker.api.errors import ConfigError, TestbedInUse
from worker.kernel.procs import start_ticks

ROOT = Path(__file__).resolve().parents[2]


def me(run_id: str = "r1") -> Holder:
    return Holder.this_process(run_id, subnet="10.240.0.0/16")


def test_free_id_is_taken_and_recorded(tmp_path):
    lock = TestbedLock("u1", str(tmp_path))
    found = lock.take(me("run-a"))
    assert found.state == "free" and lock.held
    record = json.loads((tmp_path / "u1" / "owner.json").read_text())
    assert record["pid"] == os.getpid() and record["run_id"] == "run-a" and record["kept"] is False
    assert record["start_ticks"] == start_ticks(os.getpid()) and record["details"]["subnet"] == "10.240.0.0/16"
    lock.release(forget=True)
    assert not (tmp_path / "u1" / "owner.json").exists() and not lock.held


def test_second_taker_is_refused_naming_the_holder(tmp_path):
    first = TestbedLock("u2", str(tmp_path))
    first.take(me("run-first"))
    second = TestbedLock("u2", str(tmp_path))
    with pytest.raises(TestbedInUse) as e:
        second.take(me("run-second"))
    text = e.value.message
    assert f"pid {os.getpid()}" in text and "run run-first" in text and "since 20" in text and "UTC" in text
    assert Holder.this_process().command in text and "nothing was changed" in text
    with pytest.raises(TestbedInUse):
        second.take_to_remove()
    assert first.holder().run_id == "run-first"  # the refused taker wrote nothing
    first.release(forget=True)


def test_left_record_is_stale_and_names_the_dead_holder(tmp_path):
    lock = TestbedLock("u3", str(tmp_path))
    lock.take(me("run-dead"))
    lock.release(forget=False)  # as after a crash: the record stays, the kernel dropped the lock
    again = TestbedLock("u3", str(tmp_path))
    found = again.take(me("run-new"))
    assert found.state == "stale" and found.holder.run_id == "run-dead"
    assert "testbed u3 was left by pid" in found.stale_message() and "run run-dead" in found.stale_message()
    assert again.holder().run_id == "run-new"
    again.release(forget=True)


def test_kept_testbed_is_refused_to_runs_and_removable_by_down(tmp_path):
    lock = TestbedLock("u4", str(tmp_path))
    lock.take(me("up"))
    lock.mark_kept()
    lock.release()
    with pytest.raises(TestbedInUse) as e:
        TestbedLock("u4", str(tmp_path)).take(me("run"))
    assert "already up" in e.value.message and "edgetb --id u4 down" in e.value.message
    assert TestbedLock("u4", str(tmp_path)).look().state == "kept"
    down = TestbedLock("u4", str(tmp_path))
    assert down.take_to_remove().state == "kept"
    down.release(forget=True)
    assert TestbedLock("u4", str(tmp_path)).look().state == "free"


def test_nodes_without_a_record_are_not_taken(tmp_path):
    state = tmp_path / "u5"
    state.mkdir()
    (state / "state.json").write_text(json.dumps({"version": 1, "testbed_id": "u5", "nodes": {"n1": {}},
                                                  "plans": {}, "processes": {}}))
    with pytest.raises(TestbedInUse) as e:
        TestbedLock("u5", str(tmp_path)).take(me())
    assert "no recorded process owns" in e.value.message
    assert not (state / "owner.json").exists()
    down = TestbedLock("u5", str(tmp_path))
    assert down.take_to_remove().state == "unowned"
    down.release(forget=True)


def test_a_reused_pid_is_not_the_holder():
    holder = me()
    assert holder.alive()
    holder.start_ticks = (holder.start_ticks or 0) + 1
    assert not holder.alive()


@pytest.mark.parametrize("bad", ["../x", "a/b", "toolong", "A", "", "x\n"])
def test_bad_ids_are_refused(tmp_path, bad):
    with pytest.raises(ConfigError):
        check_testbed_id(bad)
    with pytest.raises(ConfigError):
        TestbedLock(bad, str(tmp_path))


HOLD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    from controller.workers.lock import Holder, TestbedLock
    lock = TestbedLock("u6", {state!r})
    lock.take(Holder.this_process("run-child"))
    print("held", flush=True)
    time.sleep(60)
""")


def test_across_processes_busy_then_stale_after_kill_9(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", HOLD.format(root=str(ROOT), state=str(tmp_path))],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        lock = TestbedLock("u6", str(tmp_path))
        assert lock.look().state == "busy"
        with pytest.raises(TestbedInUse) as e:
            lock.take(me())
        assert f"pid {child.pid}" in e.value.message and "run run-child" in e.value.message
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=10)
        deadline = time.monotonic() + 5
        while lock.look().state == "busy" and time.monotonic() < deadline:
            time.sleep(0.05)
        found = lock.take(me())
        assert found.state == "stale" and found.holder.pid == child.pid and not found.holder.alive()
        lock.release(forget=True)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_status_bridge_address_falls_back_to_the_recorded_subnet_never_a_default():
    from worker.host import bridge_address

    assert bridge_address("etb-nosuch-br", "10.95.0.0/16") == "10.95.0.1"
    assert bridge_address("etb-nosuch-br", None) is None


def test_an_experiment_directory_has_one_live_testbed(tmp_path):
    first = DirectoryLock(str(tmp_path))
    first.take("a1", port=3340, run_id="run-a")
    with pytest.raises(TestbedInUse) as e:
        DirectoryLock(str(tmp_path)).take("b2", port=3341)
    assert (f"experiment directory {tmp_path} is in use by testbed a1 (pid {os.getpid()}, run run-a, since 20"
            in e.value.message and "curl localhost:3340/emulated/reset" in e.value.message), e.value.message
    assert oct((tmp_path / "dml_file" / "testbed.lock").stat().st_mode & 0o777) == "0o600"
    first.release()
    second = DirectoryLock(str(tmp_path))
    second.take("b2")  # free once the first let it go (or died: the kernel drops the flock)
    second.release()
    (tmp_path / "linked").mkdir()
    os.symlink(tmp_path / "dml_file", tmp_path / "linked" / "dml_file")
    with pytest.raises(ConfigError, match="must be a directory, not a link"):
        DirectoryLock(str(tmp_path / "linked")).take("c3")
    with pytest.raises(ConfigError, match="No such file"):
        DirectoryLock(str(tmp_path / "missing")).take("c3")
