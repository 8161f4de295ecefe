"""The unit tier touches nothing host-wide: its host-wide records (uid blocks, IP forwarding
holders, cgroup v2 delegation) go to a directory of the session's own."""
import pytest


@pytest.fixture(autouse=True)
def _own_run_dir(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("EDGETB_RUN_DIR", str(tmp_path_factory.getbasetemp() / "edgetb-run"))
