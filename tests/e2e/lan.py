"""Several worker hosts on one machine: each a "host" network namespace with its own agent,
joined to the others and to the controller's (this) namespace by a bridged veth LAN.

The LAN stands in for the network between real machines: the product sees only
agent URLs (HTTPS, each agent's certificate pinned by its fingerprint) and LAN addresses,
as it would across machines.
"""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from controller.workers.agent_client import AgentClient
from worker.api.errors import TestbedError
from worker.kernel import nsfs

ROOT = Path(__file__).resolve().parents[2]
AGENT_PORT = 3334


class Lan:
    """A LAN ``10.<k>.0.0/24``: this namespace is ``.1``, host namespace i is ``.(i + 2)``."""

    def __init__(self, tmp: Path) -> None:
        self.tag = secrets.token_hex(2)
        self.octet = 200 + int(self.tag, 16) % 20
        self.bridge = f"mh{self.tag}lan"
        self.comment = f"edgetb-test-lan-{self.tag}"
        self.tmp = tmp
        self.hosts: list[dict] = []
        self._rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-m", "comment", "--comment", self.comment,
                      "-j", "ACCEPT"]
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            ipr.link("add", ifname=self.bridge, kind="bridge")
            index = ipr.link_lookup(ifname=self.bridge)[0]
            ipr.addr("add", index=index, address=self.ip(None), prefixlen=24)
            ipr.link("set", index=index, state="up")
        subprocess.run(["iptables", "-w", "-I", "FORWARD", "1", *self._rule[1:]], check=True)

    def ip(self, i: Optional[int]) -> str:
        return f"10.{self.octet}.0.{1 if i is None else i + 2}"

    def add_host(self, runtime: str, subnet: Optional[str]) -> dict:
        """A host namespace on the LAN, running an agent that makes ``runtime`` nodes."""
        from pyroute2 import IPRoute, NetNS

        i = len(self.hosts)
        netns = f"mh{self.tag}h{i}"
        nsfs.create(netns)
        outer = f"mh{self.tag}v{i}"
        with IPRoute() as ipr:
            ipr.link("add", ifname=outer, kind="veth", peer={"ifname": "lan0", "net_ns_fd": netns})
            index = ipr.link_lookup(ifname=outer)[0]
            ipr.link("set", index=index, master=ipr.link_lookup(ifname=self.bridge)[0], state="up")
        with NetNS(netns, flags=0) as ns:
            ns.link("set", index=ns.link_lookup(ifname="lo")[0], state="up")
            lan0 = ns.link_lookup(ifname="lan0")[0]
            ns.addr("add", index=lan0, address=self.ip(i), prefixlen=24)
            ns.link("set", index=lan0, state="up")
        host = {"name": f"h{i}", "netns": netns, "ip": self.ip(i), "runtime": runtime,
                "id": f"m{self.tag[:2]}{i}", "state": self.tmp / f"state-h{i}",
                "url": f"https://{self.ip(i)}:{AGENT_PORT}"}
        # each agent its own token, in a file only root reads (as on real machines)
        host["token"] = secrets.token_urlsafe(24)
        host["token_file"] = self.tmp / f"token-h{i}-{self.tag}"
        fd = os.open(host["token_file"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(host["token"] + "\n")
        argv = [sys.executable, "-m", "worker.agent", "--port", str(AGENT_PORT), "--id", host["id"],
                "--runtime", runtime, "--listen", self.ip(i), "--token-file", str(host["token_file"])] + \
            (["--subnet", subnet] if subnet else [])
        env = {k: v for k, v in os.environ.items() if k != "EDGETB_TOKEN"}
        env.update(EDGETB_STATE_DIR=str(host["state"]), PYTHONPATH=str(ROOT))
        # the agent's certificate is made before it starts, as an operator does to fill hosts.json
        shown = subprocess.run([*argv, "--print-fingerprint"], env=env, cwd=str(ROOT), capture_output=True, text=True,
                               timeout=60)
        if shown.returncode != 0:
            raise AssertionError(f"the agent of h{i} printed no fingerprint: {shown.stderr}")
        host["fingerprint"] = shown.stdout.strip()
        fd = os.open(nsfs.netns_path(netns), os.O_RDONLY)
        host["log"] = open(self.tmp / f"agent-h{i}.log", "w")
        try:
            host["proc"] = subprocess.Popen(argv, env=env, cwd=str(ROOT), stdout=host["log"], stderr=subprocess.STDOUT,
                                            preexec_fn=lambda: nsfs.setns_fd(fd), start_new_session=True)
        finally:
            os.close(fd)
        self.hosts.append(host)
        deadline = time.monotonic() + 30
        probe = self.client(host, timeout_s=1, tries=1)
        while time.monotonic() < deadline:
            try:
                if probe.health()["ok"]:
                    return host
            except TestbedError:
                time.sleep(0.2)
        raise AssertionError(f"the agent of {host['name']} did not come up: {self.agent_log(host)}")

    def client(self, host: dict, **kw) -> AgentClient:
        """The agent of ``host``, its certificate pinned."""
        return AgentClient(host["url"], host["token"], name=host["name"], fingerprint=host["fingerprint"], **kw)

    def agent_log(self, host: dict) -> str:
        return (self.tmp / f"agent-{host['name']}.log").read_text()[-3000:]

    def close(self) -> list[str]:
        """Stop the agents (each resets first), remove the namespaces, the bridge and the rule;
        what the agents left behind, by testbed id."""
        left = []
        for host in self.hosts:
            try:
                self.client(host, timeout_s=60, tries=1).reset()
            except TestbedError:
                pass
            host["proc"].terminate()
            try:
                host["proc"].wait(timeout=10)
            except subprocess.TimeoutExpired:
                host["proc"].kill()
            host["log"].close()
            left += [n for n in nsfs.list_netns() if n.startswith(f"etb-{host['id']}-")]
            for pid in nsfs.pids_in(host["netns"]):
                try:
                    os.kill(pid, 9)
                except ProcessLookupError:
                    pass
            nsfs.remove(host["netns"])
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=self.bridge):
                ipr.link("del", index=index)
        subprocess.run(["iptables", "-w", "-D", *self._rule], capture_output=True)
        return left
