"""What the benchmarks that drive a worker share: a real agent on loopback for the length of a
``with`` (started with a fresh testbed id, subnet, token and state directory; reset, stopped and
checked for leftovers at the end, even on an error), nodes and links deployed from a
``Topology``, and a percentile."""
from __future__ import annotations

import os
import secrets
import signal
import string
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional

from bench_netns import BenchError, free_port, free_subnet, fresh_testbed_id, log, shielded, teardown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AGENT_START_S = 30


@contextmanager
def loopback_agent(subnet_base: str) -> Iterator[tuple[Any, subprocess.Popen]]:
    """(its client, its process): an agent on 127.0.0.1 over plain HTTP, in a subnet free near
    ``subnet_base``; taken down on leaving, its leftovers an error."""
    from controller.workers.agent_client import AgentClient
    from worker.host import WorkerHost

    subnet = free_subnet(subnet_base)
    tid = fresh_testbed_id()
    port = free_port()
    token = "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(32))
    state_dir = tempfile.mkdtemp(prefix="edgetb-bench-agent-")
    env = dict(os.environ, EDGETB_TOKEN=token, EDGETB_STATE_DIR=state_dir, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "worker.agent", "--port", str(port), "--listen", "127.0.0.1",
                             "--plain-http", "--id", tid, "--subnet", subnet], env=env, cwd=ROOT,
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    client = AgentClient(f"http://127.0.0.1:{port}", token, timeout_s=600)
    left: Optional[list[Any]] = None
    try:
        deadline = time.monotonic() + AGENT_START_S
        while True:
            try:
                client.health()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise BenchError(f"the agent did not answer within {AGENT_START_S} s") from None
                time.sleep(0.05)
        log(f"agent: testbed {tid}, port {port}, pid {proc.pid}")
        yield client, proc
    finally:
        with shielded():
            try:
                client.reset()
            except Exception as e:
                log(f"agent reset failed: {type(e).__name__}: {e}")
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            left = teardown(WorkerHost(tid, subnet, state_root=state_dir))
        if left:
            raise BenchError(f"agent testbed {tid}: reset left {left} behind")


def deploy(worker: Any, topo: Any, argv: Optional[list[str]] = None, full_segments: bool = False) -> dict[str, str]:
    """The nodes and links of ``topo`` (a ``Topology``) made by ``worker`` as a run makes them
    (``full_segments``: the kernel's 64 KB segments even when ``topo`` replays a trace); ``argv``
    started in every node; node -> IP."""
    from controller.workers.deploy import node_requests

    body = node_requests(topo)
    if full_segments:
        body["nodes"] = [{k: v for k, v in n.items() if k != "gso_max_bytes"} for n in body["nodes"]]
    created = worker.create_nodes(body)["nodes"]
    ips = {n["name"]: n["ip"] for n in created}
    worker.set_links({"version": 1, "links": [{"src": s, "dst": d, "dst_ip": ips[d], "shape": link.shape.to_dict()}
                                              for (s, d), link in topo.links.items()]})
    for name in topo.nodes if argv else ():
        worker.start_process(name, {"version": 1, "argv": argv})
    return ips


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]
