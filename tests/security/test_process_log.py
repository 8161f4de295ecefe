"""A process's log is what a node wrote: the real agent reads it as untrusted data.

The agent (``python3 -m worker.agent``) runs a process in a netns node that floods its log with
arbitrary bytes: a read returns at most 64 KiB whatever it asks for, the bytes as they are
(base64, never interpreted). Where the log file is a symbolic link to another file, or a FIFO,
the agent refuses to read it, at once, and shows nothing of the link's target.
"""
from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import pytest
import requests

from tests.netns.conftest import nodes_body
from tests.netns.test_agent_http import Agent, agent  # noqa: F401 (the fixture)
from worker.nodes.processes import MAX_LOG_READ_BYTES

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (network namespaces)")
FLOOD = "i=0; while [ $i -lt 40 ]; do printf '\\033]0;x\\007\\342\\200\\256%08192d' 0; i=$((i+1)); done; exec sleep 600"


def _log_file(tmp_path: Path, node: str, proc_id: str) -> Path:
    found = list(tmp_path.glob(f"state/**/{node}-{proc_id}.log"))
    assert len(found) == 1, found
    return found[0]


def test_a_process_log_is_read_capped_and_never_through_a_link(agent: Agent, tmp_path: Path):  # noqa: F811
    agent.client.create_nodes(nodes_body("a"))
    proc = agent.client.start_process("a", {"version": 1, "argv": ["sh", "-c", FLOOD]})
    path = f"/nodes/a/processes/{proc['id']}/log"
    log = _log_file(tmp_path, "a", proc["id"])
    deadline = time.monotonic() + 20
    while log.stat().st_size < 40 * 8192:
        assert time.monotonic() < deadline, log.stat().st_size
        time.sleep(0.05)
    answer = requests.get(agent.url + path, params={"offset": 0, "limit": 10**9}, headers=agent.auth, timeout=10)
    assert answer.status_code == 200, answer.text
    piece = answer.json()
    data = base64.b64decode(piece["data_b64"])
    assert len(data) == MAX_LOG_READ_BYTES and piece["next_offset"] == MAX_LOG_READ_BYTES
    assert data == log.read_bytes()[:MAX_LOG_READ_BYTES]  # as written: escapes and bidi bytes untouched

    secret = tmp_path / "root-only.txt"
    secret.write_text("root's secret\n")
    secret.chmod(0o600)
    log.unlink()
    log.symlink_to(secret)
    started = time.monotonic()
    answer = requests.get(agent.url + path, headers=agent.auth, timeout=10)
    assert answer.status_code >= 400 and "symbolic link" in answer.json()["detail"], answer.text
    assert "secret" not in answer.text

    log.unlink()
    os.mkfifo(log)  # a reader that blocked on it would hold the agent's call
    answer = requests.get(agent.url + path, headers=agent.auth, timeout=10)
    assert answer.status_code >= 400 and "not a regular file" in answer.json()["detail"], answer.text
    assert time.monotonic() - started < 5
