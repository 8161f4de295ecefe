"""A node's downlink: everything the node receives, shaped at one rate, shared fairly by
its peers (netlink, batched).

The node's interface gets an ``ingress`` qdisc with one u32 filter that matches every
packet (``match u32 0 0``, protocol all) and redirects it with ``mirred`` to an IFB
device in the node's own namespace. The IFB holds an HTB tree: class ``1:1`` at rate =
ceil = the downlink rate, and beneath it one class per peer (a u32 filter on the peer's
source address) plus a default class ``1:2`` for everything else (the controller, unlinked
senders). Each of those n + 1 classes has rate = downlink / (n + 1), so the guarantees add
up to the downlink, and ceil = the downlink, so a peer alone takes all of it; HTB lends the
idle classes' share to the busy ones in turn (DRR by quantum), so two busy senders get about
half each, and fifty FL uploads share it fifty ways instead of racing through one FIFO.
Each class has its own ``pfifo`` of ``LEAF_LIMIT_PKTS`` packets (an IFB's own queue is 32).
Packets leave the IFB back into the node's receive path, as the peers of an edge device
share its Wi-Fi or LTE link. The peers are the node's linked peers and the peers it reaches
without a link (the plan's rules and passes): on a testbed every link has its way back, so
they are the nodes that send to it. The equivalent commands::

    ip link add DEV type ifb && ip link set DEV up
    tc qdisc add dev DEV root handle 1: htb default 2
    tc class add dev DEV parent 1: classid 1:1 htb rate R ceil R
    tc class add dev DEV parent 1:1 classid 1:2 htb rate R/(n+1) ceil R
    tc qdisc replace dev DEV parent 1:2 handle 2: pfifo limit L
    tc class add dev DEV parent 1:1 classid 1:10 htb rate R/(n+1) ceil R      (one per peer)
    tc qdisc replace dev DEV parent 1:10 handle 10: pfifo limit L
    tc filter add dev DEV parent 1: protocol ip prio 1 u32 match ip src PEER/32 flowid 1:10
    tc qdisc add dev eth0 ingress
    tc filter add dev eth0 parent ffff: protocol all prio 1 u32 match u32 0 0 \\
        action mirred egress redirect dev DEV

(``matchall`` would do the filter's job, but this kernel has no ``cls_matchall``.) The IFB
lives inside the node's namespace (or container), so it goes with the node; removing the
downlink deletes the ingress qdisc (and its filter) and the IFB. The downlink carries all
the node receives, control traffic from the controller included.
"""
from __future__ import annotations

import socket
import struct
from dataclasses import dataclass, field
from typing import Any, Optional

from worker.api.errors import ShapingError
from worker.kernel import netlink as nl
from worker.shaping.plan import IFB_DEFAULT_MINOR, IFB_NAME, IFB_ROOT_MINOR, LEAF_LIMIT_PKTS, peer_minor, share_bps

TC_H_INGRESS = 0xFFFFFFF1
INGRESS_HANDLE = nl.tc_handle(0xFFFF, 0)
ETH_P_ALL = 0x0003
TCA_U32_ACT = 7
TCA_ACT_KIND, TCA_ACT_OPTIONS = 1, 2
TCA_MIRRED_PARMS = 2
TC_ACT_STOLEN = 4
TCA_EGRESS_REDIR = 1
_MIRRED = struct.Struct("=IIiiiiI")  # tc_gen (index, capab, action, refcnt, bindcnt), eaction, ifindex


def tree_messages(ifb: int, rate_bps: int, peers: list[str], flags: int = nl.CREATE) -> list[bytes]:
    """The IFB's classes (and, when made, their leaves and filters) for ``rate_bps`` and ``peers``;
    ``flags`` 0 changes the classes' rates in place."""
    share = share_bps(rate_bps, len(peers))
    msgs = [nl.htb_class(ifb, IFB_ROOT_MINOR, rate_bps, flags=flags),
            nl.htb_class(ifb, IFB_DEFAULT_MINOR, share, flags=flags, ceil_bps=rate_bps, parent_minor=IFB_ROOT_MINOR)]
    msgs += [nl.htb_class(ifb, peer_minor(i), share, flags=flags, ceil_bps=rate_bps, parent_minor=IFB_ROOT_MINOR)
             for i in range(len(peers))]
    if flags:
        for minor in [IFB_DEFAULT_MINOR, *(peer_minor(i) for i in range(len(peers)))]:
            msgs.append(nl.pfifo_leaf(ifb, minor, LEAF_LIMIT_PKTS))
        msgs += [nl.u32_src_filter(ifb, i + 1, ip, peer_minor(i)) for i, ip in enumerate(peers)]
    return msgs


def ifb_link(name: str) -> bytes:
    """``ip link add NAME up type ifb``."""
    body = struct.pack("=BxHiII", 0, 0, 0, nl.IFF_UP, nl.IFF_UP) + nl.attr_str(nl.IFLA_IFNAME, name)
    body += nl.attr(nl.IFLA_LINKINFO, nl.attr_str(nl.IFLA_INFO_KIND, "ifb"))
    return nl.message(nl.RTM_NEWLINK, nl.CREATE, body)


def ingress_qdisc(ifindex: int) -> bytes:
    """``tc qdisc add dev X ingress``."""
    body = struct.pack("=BxxxiIII", 0, ifindex, INGRESS_HANDLE, TC_H_INGRESS, 0) + nl.attr_str(nl.TCA_KIND, "ingress")
    return nl.message(nl.RTM_NEWQDISC, nl.CREATE, body)


def delete_ingress(ifindex: int) -> bytes:
    return nl.message(nl.RTM_DELQDISC, 0, struct.pack("=BxxxiIII", 0, ifindex, INGRESS_HANDLE, TC_H_INGRESS, 0))


def redirect_filter(ifindex: int, to_ifindex: int) -> bytes:
    """``tc filter add dev X parent ffff: protocol all prio 1 u32 match u32 0 0 action mirred
    egress redirect dev <to_ifindex>``."""
    sel = struct.pack("=BBBxHHhhI", nl.TC_U32_TERMINAL, 0, 1, 0, 0, 0, 0, 0) + struct.pack("!II", 0, 0)
    sel += struct.pack("=ii", 0, 0)
    mirred = _MIRRED.pack(0, 0, TC_ACT_STOLEN, 0, 0, TCA_EGRESS_REDIR, to_ifindex)
    action = nl.attr_str(TCA_ACT_KIND, "mirred") + nl.attr(TCA_ACT_OPTIONS, nl.attr(TCA_MIRRED_PARMS, mirred))
    options = nl.attr(nl.TCA_U32_SEL, sel) + nl.attr(TCA_U32_ACT, nl.attr(1, action))
    info = (1 << 16) | socket.htons(ETH_P_ALL)
    body = struct.pack("=BxxxiIII", 0, ifindex, 0, INGRESS_HANDLE, info) + nl.attr_str(nl.TCA_KIND, "u32")
    return nl.message(nl.RTM_NEWTFILTER, nl.CREATE, body + nl.attr(nl.TCA_OPTIONS, options))


def redirect_target(options: bytes) -> Optional[int]:
    """The ifindex a u32 filter's mirred action redirects to (None: no such action)."""
    acts = nl.parse_attrs(options).get(TCA_U32_ACT)
    if acts is None:
        return None
    for act in nl.parse_attrs(acts).values():
        fields = nl.parse_attrs(act)
        if fields.get(TCA_ACT_KIND, b"").split(b"\0", 1)[0] != b"mirred":
            continue
        parms = nl.parse_attrs(fields.get(TCA_ACT_OPTIONS, b"")).get(TCA_MIRRED_PARMS)
        if parms and len(parms) >= _MIRRED.size:
            return _MIRRED.unpack_from(parms)[6]
    return None


def set_downlink(netns: Optional[str], ifindex: int, rate_bps: Optional[int], previous_bps: Optional[int],
                 peers: tuple[str, ...] = (), previous_peers: tuple[str, ...] = ()) -> None:
    """Make the downlink of the node's interface ``ifindex`` ``rate_bps`` (None: remove it),
    shared by ``peers`` (their addresses); a rate change touches the classes in place, a change
    of peers remakes the IFB's tree (the redirect stays)."""
    peers_list = list(peers)
    with nl.RtnlSocket(netns) as sock:
        if rate_bps is None:
            sock.run([delete_ingress(ifindex), nl.delete_link(IFB_NAME)])  # absent is fine
            return
        ifb_now = sock.index_of(IFB_NAME) if previous_bps is not None else None
        if ifb_now is not None and tuple(peers) == tuple(previous_peers):
            if not sock.run(tree_messages(ifb_now, rate_bps, peers_list, flags=0)):
                return  # else the tree is not the one expected (made by an older version): made anew
        if ifb_now is not None:
            sock.run([nl.delete_root(ifb_now)])
            failures = sock.run([nl.htb_root(ifb_now, IFB_DEFAULT_MINOR), *tree_messages(ifb_now, rate_bps, peers_list)])
            _raise(netns, failures, "changing the downlink's peers")
            return
        sock.run([delete_ingress(ifindex), nl.delete_link(IFB_NAME)])
        failures = sock.run([ifb_link(IFB_NAME)])
        _raise(netns, failures, f"creating the downlink device {IFB_NAME}")
        ifb = sock.index_of(IFB_NAME)
        if ifb is None:
            raise ShapingError(f"creating the downlink device {IFB_NAME} in {netns or 'the host'}: it is not there")
        failures = sock.run([nl.htb_root(ifb, IFB_DEFAULT_MINOR), *tree_messages(ifb, rate_bps, peers_list),
                             ingress_qdisc(ifindex), redirect_filter(ifindex, ifb)])
        if failures:
            sock.run([delete_ingress(ifindex), nl.delete_link(IFB_NAME)])
        _raise(netns, failures, "shaping the downlink")


def _raise(netns: Optional[str], failures: list[nl.Failure], action: str) -> None:
    if failures:
        text = "; ".join(f.describe() for f in failures[:5])
        raise ShapingError(f"{action} in {netns or 'the host'} failed: {text}", detail={"netns": netns})


@dataclass
class Downlink:
    """What the kernel holds of a node's downlink."""

    rate_bps: Optional[int] = None  # the IFB's class 1:1 (None: no IFB or no class)
    redirect: bool = False  # the ingress filter redirects to the IFB
    peers: dict[str, int] = field(default_factory=dict)  # source address -> its class's rate, bit/s
    default_bps: Optional[int] = None  # the default class's rate

    def to_dict(self) -> dict[str, Any]:
        return {"rate_bps": self.rate_bps, "redirect": self.redirect, "peers": dict(self.peers),
                "default_bps": self.default_bps}


def read_downlink(sock: nl.RtnlSocket, ifindex: int) -> Downlink:
    """The downlink of the interface ``ifindex``, read on ``sock`` (open in its namespace)."""
    seen = Downlink()
    ifb = sock.index_of(IFB_NAME)
    if ifb is None:
        return seen
    rates: dict[int, int] = {}
    for c in nl.tc_dump(sock, nl.RTM_GETTCLASS, ifb):
        rate = nl.htb_rate_bytes(c.options) if c.kind == "htb" else None
        if rate is not None:
            rates[c.handle & 0xFFFF] = rate * 8
    seen.rate_bps = rates.get(IFB_ROOT_MINOR)
    seen.default_bps = rates.get(IFB_DEFAULT_MINOR)
    for f in nl.tc_dump(sock, nl.RTM_GETTFILTER, ifb, nl.tc_handle(1, 0)):
        if f.kind != "u32":
            continue
        classid, keys = nl.u32_key(f.options)
        src = nl.dst_prefix(keys, nl.IP_SRC_OFFSET) if classid is not None else None
        if src is not None:
            seen.peers[src] = rates.get(classid & 0xFFFF, 0)
    for f in nl.tc_dump(sock, nl.RTM_GETTFILTER, ifindex, INGRESS_HANDLE):
        if f.kind == "u32" and redirect_target(f.options) == ifb:
            seen.redirect = True
    return seen


def downlink_mismatches(rate_bps: Optional[int], seen: Downlink, peers: tuple[str, ...] = ()) -> list[str]:
    """How the kernel's downlink differs from ``rate_bps`` shared by ``peers`` (None: no downlink)."""
    if rate_bps is None:
        return [f"downlink {seen.rate_bps} bit/s is not in the plan"] if seen.rate_bps or seen.redirect else []
    problems = []
    if seen.rate_bps != rate_bps // 8 * 8:
        problems.append(f"downlink: rate {seen.rate_bps} bit/s, expected {rate_bps // 8 * 8}")
    share = share_bps(rate_bps, len(peers)) // 8 * 8
    if seen.default_bps != share:
        problems.append(f"downlink: default class rate {seen.default_bps} bit/s, expected {share}")
    if set(seen.peers) != set(peers):
        missing, extra = sorted(set(peers) - set(seen.peers)), sorted(set(seen.peers) - set(peers))
        problems.append(f"downlink peers: missing {missing}, not in the plan {extra}")
    wrong = sorted(ip for ip in set(peers) & set(seen.peers) if seen.peers[ip] != share)
    if wrong:
        problems.append(f"downlink: the classes of {wrong} are not at their share {share} bit/s")
    if not seen.redirect:
        problems.append(f"downlink: no ingress redirect to {IFB_NAME}")
    return problems
