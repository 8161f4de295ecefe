"""The unit tier touches nothing host-wide: its host-wide records (uid blocks, IP forwarding
holders, cgroup v2 delegation) go to a directory of the session's own."""
import pytest


@pytest.fixture(autouse=True)
def _own_run_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EDGETB_RUN_DIR", str(tmp_path_factory.getbasetemp() / "edgetb-run"))


@pytest.fixture
def one_node_plan() -> dict:
    """Node a's shaping plan: links to b (class 16) and c (class 17) at 1 Mbit/s."""
    return {"ifname": "eth0", "rules": [{"dest": d, "minor": m, "shape": {"rate_bps": 10**6}} for d, m in
                                        (("b", 16), ("c", 17))]}
