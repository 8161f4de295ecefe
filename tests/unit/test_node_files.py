"""Files a node wrote are read as untrusted: a FIFO or a device never blocks, a link (soft or
hard) or another uid's file is refused, each with the file named."""
import os
import threading

import pytest

from controller.results.run_dir import NodeFileError, read_node_file, read_node_file_tail


@pytest.fixture
def node_dir(tmp_path):
    d = tmp_path / "dml_file" / "node" / "n1"
    d.mkdir(parents=True)
    return d


def test_a_regular_file_of_the_node_is_read(tmp_path, node_dir):
    (node_dir / "r.jsonl").write_bytes(b'{"type": "done"}\n')
    assert read_node_file(str(tmp_path), "n1", "r.jsonl", 100, os.getuid()) == b'{"type": "done"}\n'
    with pytest.raises(FileNotFoundError):
        read_node_file(str(tmp_path), "n1", "missing.jsonl", 100)
    with pytest.raises(NodeFileError, match="17 bytes, more than the 4 allowed"):
        read_node_file(str(tmp_path), "n1", "r.jsonl", 4)


def test_the_tail_of_a_node_file_is_read_under_the_same_checks(tmp_path, node_dir):
    (node_dir / "r.jsonl").write_bytes(b'{"type": "round"}\n{"type": "done"}\n')
    assert read_node_file_tail(str(tmp_path), "n1", "r.jsonl", 17, os.getuid()) == b'{"type": "done"}\n'
    assert read_node_file_tail(str(tmp_path), "n1", "r.jsonl", 1000) == (node_dir / "r.jsonl").read_bytes()
    os.symlink(node_dir / "r.jsonl", node_dir / "soft")
    with pytest.raises(NodeFileError, match="symbolic link"):
        read_node_file_tail(str(tmp_path), "n1", "soft", 100)
    with pytest.raises(NodeFileError, match="not the node's"):
        read_node_file_tail(str(tmp_path), "n1", "r.jsonl", 100, os.getuid() + 1)


def test_a_fifo_is_refused_at_once(tmp_path, node_dir):
    os.mkfifo(node_dir / "r.jsonl")
    done = []
    reader = threading.Thread(target=lambda: done.append(_refusal(tmp_path, "r.jsonl")), daemon=True)
    reader.start()
    reader.join(5)
    if reader.is_alive():  # unblock the reader before failing
        os.close(os.open(node_dir / "r.jsonl", os.O_WRONLY | os.O_NONBLOCK))
    assert done and "not a regular file" in done[0], "reading a FIFO blocked"


def test_links_are_refused(tmp_path, node_dir):
    (tmp_path / "secret").write_bytes(b"root's")
    os.symlink(tmp_path / "secret", node_dir / "soft")
    os.link(tmp_path / "secret", node_dir / "hard")
    assert "symbolic link" in _refusal(tmp_path, "soft")
    assert "2 links" in _refusal(tmp_path, "hard")
    os.symlink(node_dir, tmp_path / "dml_file" / "node" / "n2")
    with pytest.raises(NodeFileError, match="symbolic link on the way"):
        read_node_file(str(tmp_path), "n2", "soft", 100)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another uid needs root")
def test_another_uids_file_is_refused(tmp_path, node_dir):
    (node_dir / "r.jsonl").write_bytes(b"{}\n")
    os.chown(node_dir / "r.jsonl", 1_000_000_007, 1_000_000_007)
    assert "owned by uid 1000000007, not the node's 1000000001" in _refusal(tmp_path, "r.jsonl", 1_000_000_001)
    assert read_node_file(str(tmp_path), "n1", "r.jsonl", 100, 1_000_000_007) == b"{}\n"


def _refusal(tmp_path, name, uid=None) -> str:
    try:
        read_node_file(str(tmp_path), "n1", name, 100, uid)
    except NodeFileError as e:
        return e.message
    return "read"
