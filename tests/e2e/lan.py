"""Several worker hosts on one machine: each a "host" network namespace with its own agent,
joined to the others and to the controller's (this) namespace by a bridged veth LAN.

The LAN stands in for the network between real machines: the product sees only
agent URLs (HTTPS, each agent's certificate pinned by its fingerprint) and LAN addresses,
as it would across machines.
"""
from __future__ import annotations

import os
import secrets
import socket
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


OCTETS = range(200, 220)  # the LANs' second octets: 10.<octet>.0.0/24


def free_octet() -> int:
    """A second octet of ``OCTETS`` whose /24 no interface of this namespace has (another LAN
    alive at the same time, a tier's shared one, must not share its addresses), picked at random."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        used = {int(a.get_attr("IFA_ADDRESS").split(".")[1]) for a in ipr.get_addr(family=socket.AF_INET)
                if a.get_attr("IFA_ADDRESS", "").startswith("10.")}
    free = [o for o in OCTETS if o not in used]
    if not free:
        raise AssertionError(f"every LAN subnet 10.{OCTETS[0]}-{OCTETS[-1]}.0.0/24 is in use here")
    return secrets.choice(free)


class Lan:
    """A LAN ``10.<k>.0.0/24``: this namespace is ``.1``, host namespace i is ``.(i + 2)``."""

    def __init__(self, tmp: Path) -> None:
        self.tag = secrets.token_hex(2)
        self.octet = free_octet()
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
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                if probe.health()["ok"]:
                    return host
            except TestbedError as e:
                last = e.message
                time.sleep(0.2)
        route = subprocess.run(["ip", "route", "get", host["ip"]], capture_output=True, text=True).stdout
        neigh = subprocess.run(["ip", "neigh", "show", host["ip"]], capture_output=True, text=True).stdout
        raise AssertionError(f"the agent of {host['name']} did not come up ({last}; route {route.strip()}; "
                             f"neighbour {neigh.strip()}; sockets:\n{sockets_in(netns)}):\n{self.agent_log(host)}")

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
            host["inode"] = nsfs.inode(host["netns"])
            host["sockets_at_close"] = sockets_in(host["netns"])
            close_sockets(host["netns"])
            nsfs.remove(host["netns"])
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            for index in ipr.link_lookup(ifname=self.bridge):
                ipr.link("del", index=index)
        subprocess.run(["iptables", "-w", "-D", *self._rule], capture_output=True)
        return left


def sockets_in(netns: str) -> str:
    """``ss -tuanpeo`` in namespace ``netns`` (every TCP/UDP socket, its state, timer and owner)."""
    out = subprocess.run(["nsenter", f"--net={nsfs.netns_path(netns)}", "ss", "-tuanpeo"], capture_output=True,
                         text=True, timeout=10)
    return out.stdout + out.stderr


def close_sockets(netns: str) -> None:
    """Close every TCP socket left in namespace ``netns`` once its processes are gone (sock_diag's
    destroy, ``ss -K``). A socket whose process was killed mid-close (FIN-WAIT-1 towards a peer
    about to go too) would otherwise retransmit for minutes, and keep the namespace and its LAN
    veth alive that long."""
    subprocess.run(["nsenter", f"--net={nsfs.netns_path(netns)}", "ss", "-K", "-t", "-a"], capture_output=True,
                   timeout=10)


def netns_holders(inode: int) -> list[str]:
    """What keeps the network namespace ``inode`` alive that /proc shows: processes in it, open
    descriptors of it, and mounts of it in any mount namespace (sockets are not shown here)."""
    mark, found = f"net:[{inode}]", []
    for pid in (int(e) for e in os.listdir("/proc") if e.isdigit()):
        try:
            if os.readlink(f"/proc/{pid}/ns/net") == mark:
                found.append(f"process {pid} runs in it")
            for fd in os.listdir(f"/proc/{pid}/fd"):
                if os.readlink(f"/proc/{pid}/fd/{fd}") == mark:
                    found.append(f"process {pid} holds it open (fd {fd})")
            with open(f"/proc/{pid}/mountinfo") as f:
                found += [f"mounted in the mount namespace of {pid}: {line.split()[4]}" for line in f if mark in line]
        except OSError:
            continue
    return sorted(set(found))
