"""Token files: read only when a regular file of root's, the caller's or the sudo user's, mode 0600."""
import os

import pytest

from worker.agent import read_token_file
from worker.api.errors import ConfigError

TOKEN = "t" * 32


def _token_file(path, mode=0o600):
    path.write_text(TOKEN + "\n")
    os.chmod(path, mode)
    return path


def test_a_private_token_file_is_read(tmp_path):
    assert read_token_file(str(_token_file(tmp_path / "token"))) == TOKEN


def test_a_token_file_open_to_others_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="chmod 600"):
        read_token_file(str(_token_file(tmp_path / "token", 0o644)))


def test_a_symbolic_link_is_refused(tmp_path):
    real = _token_file(tmp_path / "real")
    (tmp_path / "token").symlink_to(real)
    with pytest.raises(ConfigError, match="symbolic link"):
        read_token_file(str(tmp_path / "token"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")
def test_another_users_token_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("SUDO_UID", raising=False)
    path = _token_file(tmp_path / "token")
    os.chown(path, 65534, 65534)  # nobody's file: nobody knows the token
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        read_token_file(str(path))
    monkeypatch.setenv("SUDO_UID", "65534")  # the user who ran sudo: theirs to give
    assert read_token_file(str(path)) == TOKEN
