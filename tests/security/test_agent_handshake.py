"""An agent's TLS port held by connections that never send a ClientHello (the audit's attacks 10
and 11): the real agent process, the real client with its pinned certificate, attackers as real
processes. An authenticated call must answer while they are held, and the held connections must
be closed by the handshake's deadline, not kept for ever."""
from __future__ import annotations

import time

import pytest

from controller.workers.agent_client import AgentClient
from tests.security.test_agent_transport import TOKEN, agents, fingerprint_of  # noqa: F401  (fixture)
from tests.security.test_availability import HEAD_DEADLINE_BOUND_S, ROOT_BOUND_S, Attacker, hold

pytestmark = [pytest.mark.security]

CONNECTIONS = 1000


def _timed_status(client: AgentClient) -> float:
    started = time.monotonic()
    assert client.status()["version"] == 1
    return time.monotonic() - started


def _closed_lifetimes(attacker: Attacker, count: int, timeout_s: float) -> list[float]:
    """How long each of the first ``count`` connections the agent closed had lived (the attacker
    reports each close; with no retries, none is opened again)."""
    deadline = time.monotonic() + timeout_s
    while len(attacker.all("closed")) < count and time.monotonic() < deadline:
        time.sleep(0.2)  # polling the attacker's report, bounded by the deadline
    return [float(x) for x in attacker.all("closed")]


@pytest.mark.parametrize("uid", [65534, 0], ids=["nobody", "root-trusted-uncapped"])
def test_connections_that_never_say_hello_neither_lock_out_the_agent_nor_stay(agents, uid):
    """As nobody, most of the 1,000 are refused at accept (a caller's share); as root (trusted,
    never refused for room) all are accepted and wait in the handshake. Either way an
    authenticated call answers at once, and every held connection is closed by the deadline."""
    agent = agents("--listen", "127.0.0.1").start()
    client = AgentClient(f"https://127.0.0.1:{agent.port}", TOKEN, name="e1", fingerprint=fingerprint_of(agent),
                         tries=1, timeout_s=10)
    with hold([{"host": "127.0.0.1", "port": agent.port, "count": CONNECTIONS}], "idle", retry=1e9,
              report_closes=True, uid=uid) as attacker:
        ready = attacker.wait_json("ready", 40)
        assert ready["opened"] >= CONNECTIONS // 2, ready
        at_start = [_timed_status(client) for _ in range(3)]
        lifetimes = _closed_lifetimes(attacker, ready["opened"], HEAD_DEADLINE_BOUND_S + 5)
        after = _timed_status(client)
        held = attacker.last("status")
    assert max(at_start) <= ROOT_BOUND_S, f"authenticated calls while {ready} were held: {at_start}"
    assert after <= ROOT_BOUND_S, f"an authenticated call after the hold: {after:.2f} s"
    assert len(lifetimes) >= ready["opened"], (f"only {len(lifetimes)} of {ready['opened']} never-hello "
                                                f"connections were closed by the agent (last {held})")
    assert max(lifetimes) <= HEAD_DEADLINE_BOUND_S, f"a never-hello connection lived {max(lifetimes):.1f} s"
    if uid == 0:  # all were let in: the deadline, not a refusal, closed them
        assert sorted(lifetimes)[len(lifetimes) // 2] >= 5, sorted(lifetimes)[:10]
