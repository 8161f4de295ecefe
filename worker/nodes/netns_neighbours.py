"""Permanent neighbour (ARP) entries for netns nodes, with MAC addresses fixed by address.

On a bridge of hundreds of ports, every ARP resolution is a broadcast that reaches every port
(and, when the bridge's frames go through iptables, every copy is filtered); under load some
resolutions fail and sends to a linked peer time out. Dynamic entries also count against the
kernel's neighbour-table limits (``gc_thresh3``, host-wide), which a thousand nodes with ten
peers each exceed. So a node's MAC address follows from its IPv4 address (``node_mac``), and each
node holds permanent entries for its gateway (the bridge) and for the peers it has links with;
the host holds one on the bridge for every node. Permanent entries are never resolved, never
expire and do not count against the limits. ARP itself is untouched: anything else is resolved
as usual, and the bridge learns where each MAC address is as usual.

Entries are programmed over netlink in batches (``worker.kernel.netlink``); they go with the node's
namespace and the bridge at reset.
"""
from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Optional

from worker.kernel import netlink as nl

RTM_NEWNEIGH, RTM_GETNEIGH = 28, 30
NDA_DST, NDA_LLADDR = 1, 2
NUD_PERMANENT = 0x80
IFLA_ADDRESS = 1
MAC_PREFIX = (0x02, 0xEB)  # locally administered, unicast
_NDMSG = struct.Struct("=BxxxiHBB")  # family, ifindex, state, flags, type


def node_mac(ip: str) -> str:
    """The MAC address of the interface holding ``ip``: ``02:eb:`` and the address's four bytes
    (addresses are unique on a host, so the MAC addresses are)."""
    return ":".join(f"{b:02x}" for b in (*MAC_PREFIX, *ipaddress.IPv4Address(ip).packed))


def _mac_bytes(mac: str) -> bytes:
    return bytes(int(x, 16) for x in mac.split(":"))


def set_mac(ifindex: int, mac: str) -> bytes:
    """``ip link set dev <ifindex> address <mac>``."""
    body = nl.IFINFO.pack(0, 0, ifindex, 0, 0) + nl.attr(IFLA_ADDRESS, _mac_bytes(mac))
    return nl.message(nl.RTM_NEWLINK, 0, body)


def permanent(ifindex: int, ip: str, mac: str) -> bytes:
    """``ip neigh replace <ip> lladdr <mac> dev <ifindex> nud permanent``."""
    body = _NDMSG.pack(socket.AF_INET, ifindex, NUD_PERMANENT, 0, 0)
    body += nl.attr(NDA_DST, ipaddress.IPv4Address(ip).packed) + nl.attr(NDA_LLADDR, _mac_bytes(mac))
    return nl.message(RTM_NEWNEIGH, nl.REPLACE, body)


@dataclass(frozen=True)
class Entry:
    """One IPv4 neighbour entry as the kernel reports it."""

    ifindex: int
    ip: str
    mac: Optional[str]
    state: int

    @property
    def permanent(self) -> bool:
        return bool(self.state & NUD_PERMANENT)


def dump(sock: nl.RtnlSocket) -> list[Entry]:
    """Every IPv4 neighbour entry of the socket's namespace."""
    request = nl.message(RTM_GETNEIGH, nl.NLM_F_DUMP, _NDMSG.pack(socket.AF_INET, 0, 0, 0, 0))
    found = []
    for reply in sock.dump(request):
        family, ifindex, state, _, _ = _NDMSG.unpack_from(reply, nl.HDR.size)
        if family != socket.AF_INET:
            continue
        attrs = nl.parse_attrs(reply, nl.HDR.size + _NDMSG.size)
        if NDA_DST not in attrs:
            continue
        lladdr = attrs.get(NDA_LLADDR)
        mac = ":".join(f"{b:02x}" for b in lladdr) if lladdr else None
        found.append(Entry(ifindex, socket.inet_ntoa(attrs[NDA_DST][:4]), mac, state))
    return found


def read(netns: Optional[str] = None) -> list[Entry]:
    """The IPv4 neighbour entries of namespace ``netns`` (the host's when None)."""
    with nl.RtnlSocket(netns) as sock:
        return dump(sock)


def entries_for(ifindex: int, ips: Iterable[str]) -> list[bytes]:
    """Permanent entries on ``ifindex`` for every address of ``ips`` (each once), MACs by address."""
    return [permanent(ifindex, ip, node_mac(ip)) for ip in dict.fromkeys(ips)]
