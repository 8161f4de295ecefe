"""A node's downlink: everything the node receives, shaped at one rate (netlink, batched).

The node's interface gets an ``ingress`` qdisc with one u32 filter that matches every
packet (``match u32 0 0``, protocol all) and redirects it with ``mirred`` to an IFB
device in the node's own namespace; the IFB holds an HTB root whose default class
``1:1`` has rate = ceil = the downlink rate. Packets leave the IFB back into the node's
receive path, so every sender shares the node's downlink, as the peers of an edge device
share its Wi-Fi or LTE link. The equivalent commands::

    ip link add DEV type ifb && ip link set DEV up
    tc qdisc add dev DEV root handle 1: htb default 1
    tc class add dev DEV parent 1: classid 1:1 htb rate R ceil R
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
from dataclasses import dataclass
from typing import Any, Optional

from worker import netlink as nl
from worker import nsfs
from worker.errors import ShapingError

IFB_NAME = "edgetb-down"
TC_H_INGRESS = 0xFFFFFFF1
INGRESS_HANDLE = nl.tc_handle(0xFFFF, 0)
ETH_P_ALL = 0x0003
TCA_U32_ACT = 7
TCA_ACT_KIND, TCA_ACT_OPTIONS = 1, 2
TCA_MIRRED_PARMS = 2
TC_ACT_STOLEN = 4
TCA_EGRESS_REDIR = 1
_MIRRED = struct.Struct("=IIiiiiI")  # tc_gen (index, capab, action, refcnt, bindcnt), eaction, ifindex
_IFB_ROOT_MINOR = 1


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


def _ifb_index(netns: Optional[str]) -> Optional[int]:
    """The IFB's index in ``netns`` (None: there is none)."""
    try:
        if netns is None:
            return socket.if_nametoindex(IFB_NAME)
        with nsfs.entered(netns):
            return socket.if_nametoindex(IFB_NAME)
    except OSError:
        return None


def set_downlink(netns: Optional[str], ifindex: int, rate_bps: Optional[int], previous_bps: Optional[int]) -> None:
    """Make the downlink of the node's interface ``ifindex`` ``rate_bps`` (None: remove it); a
    rate change touches one class."""
    with nl.RtnlSocket(netns) as sock:
        if rate_bps is None:
            sock.run([delete_ingress(ifindex), nl.delete_link(IFB_NAME)])  # absent is fine
            return
        ifb_now = _ifb_index(netns) if previous_bps is not None else None
        if ifb_now is not None:
            failures = sock.run([nl.htb_class(ifb_now, _IFB_ROOT_MINOR, rate_bps, flags=0)])
            _raise(netns, failures, "changing the downlink")
            return
        sock.run([delete_ingress(ifindex), nl.delete_link(IFB_NAME)])
        failures = sock.run([ifb_link(IFB_NAME)])
        _raise(netns, failures, f"creating the downlink device {IFB_NAME}")
        ifb = _ifb_index(netns)
        if ifb is None:
            raise ShapingError(f"creating the downlink device {IFB_NAME} in {netns or 'the host'}: it is not there")
        failures = sock.run([nl.htb_root(ifb, _IFB_ROOT_MINOR), nl.htb_class(ifb, _IFB_ROOT_MINOR, rate_bps),
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

    def to_dict(self) -> dict[str, Any]:
        return {"rate_bps": self.rate_bps, "redirect": self.redirect}


def read_downlink(sock: nl.RtnlSocket, netns: Optional[str], ifindex: int) -> Downlink:
    """The downlink of the interface ``ifindex``, read on ``sock`` (open in ``netns``)."""
    seen = Downlink()
    ifb = _ifb_index(netns)
    if ifb is None:
        return seen
    for c in nl.tc_dump(sock, nl.RTM_GETTCLASS, ifb):
        if c.handle & 0xFFFF == _IFB_ROOT_MINOR and c.kind == "htb":
            rate = nl.htb_rate_bytes(c.options)
            seen.rate_bps = None if rate is None else rate * 8
    for f in nl.tc_dump(sock, nl.RTM_GETTFILTER, ifindex, INGRESS_HANDLE):
        if f.kind == "u32" and redirect_target(f.options) == ifb:
            seen.redirect = True
    return seen


def downlink_mismatches(rate_bps: Optional[int], seen: Downlink) -> list[str]:
    """How the kernel's downlink differs from ``rate_bps`` (None: no downlink)."""
    if rate_bps is None:
        return [f"downlink {seen.rate_bps} bit/s is not in the plan"] if seen.rate_bps or seen.redirect else []
    problems = []
    if seen.rate_bps != rate_bps // 8 * 8:
        problems.append(f"downlink: rate {seen.rate_bps} bit/s, expected {rate_bps // 8 * 8}")
    if not seen.redirect:
        problems.append(f"downlink: no ingress redirect to {IFB_NAME}")
    return problems
