"""The fixtures the netns and docker tiers share: one factory of hosts, each reset and checked."""
from __future__ import annotations

from typing import Any, Optional

import pytest

from tests.netns import conftest as netns


class _Host:
    """A WorkerHost that records how it was made and reset."""

    def __init__(self, testbed_id: str, subnet: str, state_root: Optional[str] = None, runtime: Optional[str] = None,
                 runtime_options: Optional[dict[str, Any]] = None) -> None:
        self.testbed_id, self.subnet, self.state_root = testbed_id, subnet, state_root
        self.runtime, self.options, self.resets = runtime, runtime_options, 0

    def reset(self) -> None:
        self.resets += 1


def test_a_tier_s_hosts_are_made_apart_and_all_reset_and_checked(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "WorkerHost", _Host)
    monkeypatch.setattr(netns, "free_subnet", lambda: "10.201.0.0/16")
    checked: list[_Host] = []
    factory = netns.host_factory(tmp_path, checked.append, runtime="docker")
    make = next(factory)
    a, b = make(), make("tb1", "10.202.0.0/16", image="edgetb-node:test")
    c = make(state_dir=str(tmp_path / "mine"))
    assert a.testbed_id != b.testbed_id == "tb1" and (a.subnet, b.subnet) == ("10.201.0.0/16", "10.202.0.0/16")
    assert a.state_root.startswith(str(tmp_path / f"state-{a.testbed_id}-")) and c.state_root == str(tmp_path / "mine")
    assert {h.runtime for h in (a, b, c)} == {"docker"} and (a.options, b.options) == (None, {"image": "edgetb-node:test"})
    with pytest.raises(StopIteration):  # the teardown
        next(factory)
    assert [h.resets for h in (a, b, c)] == [1, 1, 1] and checked == [a, b, c]


def test_the_netns_tier_s_hosts_are_of_the_default_runtime(tmp_path, monkeypatch):
    monkeypatch.setattr(netns, "WorkerHost", _Host)
    monkeypatch.setattr(netns, "free_subnet", lambda: "10.201.0.0/16")
    factory = netns.host_factory(tmp_path, lambda host: None)
    host = next(factory)()
    assert host.runtime is None and host.options is None  # WorkerHost's default: netns
    factory.close()
