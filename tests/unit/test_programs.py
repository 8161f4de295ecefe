"""Programs in nodes, the pure parts: the bounded log reader, text made printable, --env, following a log."""
from __future__ import annotations

import base64
import os
from typing import Any

import pytest

from controller.workers import programs
from worker.api.errors import ConfigError, NodeRuntimeError, NotFound
from worker.nodes.processes import MAX_LOG_READ_BYTES, read_log_bytes


def test_the_log_reader_reads_from_an_offset_within_its_cap(tmp_path):
    log = tmp_path / "p.log"
    log.write_bytes(b"0123456789")
    assert read_log_bytes(str(log), 0, 4) == (b"0123", 10)
    assert read_log_bytes(str(log), 8, 100) == (b"89", 10)
    assert read_log_bytes(str(log), 10, 100) == (b"", 10)
    assert read_log_bytes(str(log), 50, 100) == (b"", 10)  # past the end: nothing, no error
    log.write_bytes(b"x" * (3 * MAX_LOG_READ_BYTES))
    data, size = read_log_bytes(str(log), 1, 10 * MAX_LOG_READ_BYTES)
    assert len(data) == MAX_LOG_READ_BYTES and size == 3 * MAX_LOG_READ_BYTES
    with pytest.raises(ConfigError, match="non-negative offset"):
        read_log_bytes(str(log), -1, 10)


def test_the_log_reader_follows_no_link_and_reads_only_regular_files(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("token")
    (tmp_path / "p.log").symlink_to(secret)
    with pytest.raises(NodeRuntimeError, match=r"p\.log: a symbolic link"):
        read_log_bytes(str(tmp_path / "p.log"), 0, 100)
    os.mkfifo(tmp_path / "f.log")  # would block a reader that opened it without O_NONBLOCK
    with pytest.raises(NodeRuntimeError, match="not a regular file"):
        read_log_bytes(str(tmp_path / "f.log"), 0, 100)
    with pytest.raises(NotFound, match="no log file"):
        read_log_bytes(str(tmp_path / "gone.log"), 0, 100)


@pytest.mark.parametrize("raw, shown", [
    ("plain\ttext\n", "plain\ttext\n"),
    ("\x1b[31mred\x1b[0m\n", "red\n"),
    ("\x1b]0;new title\x07after", "after"),
    ("\x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\", "link"),
    ("clear\x1b[2J\x1b[H screen", "clear screen"),
    ("a \u202egnp.exe\u202c b\u2066c\u2069\n", "a gnp.exe bc\n"),
    ("over\rwrite\x08\x00\x7f\x9b", "overwrite"),
    ("é ü 中", "é ü 中"),
])
def test_printable_removes_escapes_and_control_characters(raw, shown):
    assert programs.printable(raw) == shown


def test_an_escape_cut_by_the_end_of_a_read_waits_for_the_rest():
    assert programs.split_open_escape("ab\x1b[3") == ("ab", "\x1b[3")
    assert programs.split_open_escape("ab\x1b]0;ti") == ("ab", "\x1b]0;ti")
    assert programs.split_open_escape("ab\x1b[31mc") == ("ab\x1b[31mc", "")
    long_open = "a\x1b]" + "x" * 300
    assert programs.split_open_escape(long_open) == (long_open, "")  # never held without bound


def test_env_pairs():
    assert programs.check_env(["A=1", "B_2=x=y", "C="]) == {"A": "1", "B_2": "x=y", "C": ""}
    for bad in ("A", "=1", "1A=2", "A B=1"):
        with pytest.raises(ConfigError, match="NAME=VALUE"):
            programs.check_env([bad])


class _Logs:
    """A worker holding one process whose log grows by the pieces given, then ends."""

    is_local = False

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces, self.log, self.reads = list(pieces), b"", []

    def processes(self) -> dict[str, Any]:
        return {"processes": [{"id": "p1", "node": "n1", "running": True}]}

    def process_log(self, node: str, proc_id: str, offset: int = 0) -> dict[str, Any]:
        self.reads.append(offset)
        if self.pieces:
            self.log += self.pieces.pop(0)
        data = self.log[offset:offset + 4]
        return {"data_b64": base64.b64encode(data).decode(), "next_offset": offset + len(data),
                "running": bool(self.pieces)}


def test_follow_reads_on_from_each_offset_and_joins_split_characters():
    worker = _Logs([b"ab\xc3", b"", b"\xa9\x1b[1m!\x1b]0;a title\x07\n"])  # é and escapes split by reads
    text = "".join(programs.follow(worker, "p1", poll_s=0))  # type: ignore[arg-type]
    assert text == "abé!\n"
    assert worker.reads[0] == 0 and worker.reads == sorted(worker.reads)
    once = _Logs([b"abcdef"])
    assert "".join(programs.follow(once, "p1", keep_following=False)) == "abcdef"  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="no process 'p9'"):
        list(programs.follow(worker, "p9"))  # type: ignore[arg-type]
