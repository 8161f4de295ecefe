"""A small rtnetlink client that sends many requests in one go.

pyroute2 encodes about 2,500 tc messages per second and waits for each answer;
a shaping plan for a node with hundreds of peers needs thousands. Here the
handful of message kinds the testbed sends (HTB root and classes, u32 filters,
pfifo leaves, veth pairs, addresses) are packed with ``struct``, sent in large
buffers, and their acknowledgements collected afterwards; tc state is dumped
and decoded the same way. pyroute2 encodes the rare netem leaf and handles the
host's links and addresses.
"""
from __future__ import annotations

import errno
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

from worker.kernel import nsfs

NETLINK_ROUTE = 0
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_ECHO = 0x8
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
NLM_F_ACK_TLVS = 0x200
NLMSGERR_ATTR_MSG = 1
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
SO_SNDBUFFORCE = 32
SO_RCVBUFFORCE = 33

RTM_NEWLINK, RTM_DELLINK = 16, 17
RTM_NEWADDR = 20
RTM_NEWROUTE = 24
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PREFSRC = 1, 4, 5, 7
RT_TABLE_MAIN, RTPROT_BOOT, RTN_UNICAST = 254, 3, 1
RTM_NEWQDISC, RTM_DELQDISC, RTM_GETQDISC = 36, 37, 38
RTM_NEWTCLASS, RTM_DELTCLASS, RTM_GETTCLASS = 40, 41, 42
RTM_NEWTFILTER, RTM_DELTFILTER, RTM_GETTFILTER = 44, 45, 46
NLM_F_DUMP = 0x300

IFLA_IFNAME, IFLA_MASTER, IFLA_TXQLEN, IFLA_LINKINFO, IFLA_AF_SPEC, IFLA_NET_NS_FD = 3, 10, 13, 18, 26, 28
IFLA_GSO_MAX_SIZE = 41
IFLA_INET6_ADDR_GEN_MODE, IN6_ADDR_GEN_MODE_NONE = 8, 1
IFLA_INFO_KIND, IFLA_INFO_DATA = 1, 2
VETH_INFO_PEER = 1
IFA_LOCAL, IFA_ADDRESS = 2, 1
IFF_UP = 0x1
TCA_KIND, TCA_OPTIONS = 1, 2
TCA_HTB_PARMS, TCA_HTB_INIT, TCA_HTB_RATE64, TCA_HTB_CEIL64 = 1, 2, 6, 7
TCA_U32_CLASSID, TCA_U32_SEL = 1, 5
TC_U32_TERMINAL = 1
TC_H_ROOT = 0xFFFFFFFF
TC_LINKLAYER_ETHERNET = 1
ETH_P_IP = 0x0800
ETH_P_IPV6 = 0x86DD
U32_ROOT_HT = 0x800

CREATE = NLM_F_CREATE | NLM_F_EXCL
REPLACE = NLM_F_CREATE | NLM_F_REPLACE
CHUNK_BYTES = 64 * 1024

HDR = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_TCMSG = struct.Struct("=BxxxiIII")  # family, ifindex, handle, parent, info
IFINFO = struct.Struct("=BxHiII")  # family, type, index, flags, change
_IFADDR = struct.Struct("=BBBBI")  # family, prefixlen, flags, scope, index
_RTMSG = struct.Struct("=BBBBBBBBI")  # family, dst_len, src_len, tos, table, protocol, scope, type, flags
_RATESPEC = struct.Struct("=BBHhHI")  # cell_log, linklayer, overhead, cell_align, mpu, rate


def _psched_tick_per_us() -> float:
    """Kernel packet-scheduler ticks per microsecond, from /proc/net/psched (as tc reads it)."""
    try:
        with open("/proc/net/psched") as f:
            t2us, us2t, clock_res = (int(x, 16) for x in f.read().split()[:3])
    except (OSError, ValueError):
        return 1.0
    if clock_res == 1_000_000_000:
        t2us = us2t
    return t2us / us2t * (clock_res / 1_000_000)


TICKS_PER_US = _psched_tick_per_us()


def attr(kind: int, payload: bytes) -> bytes:
    """One rtattr (type-length-value), padded to 4 bytes."""
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def attr_str(kind: int, text: str) -> bytes:
    return attr(kind, text.encode() + b"\0")


def attr_u32(kind: int, value: int) -> bytes:
    return attr(kind, struct.pack("=I", value))


def message(kind: int, flags: int, body: bytes) -> bytes:
    """A request; its sequence number is filled in when it is sent."""
    return HDR.pack(HDR.size + len(body), kind, flags | NLM_F_REQUEST | NLM_F_ACK, 0, 0) + body


def tc_handle(major: int, minor: int) -> int:
    return (major << 16) | minor


def _tcmsg(ifindex: int, handle: int, parent: int, info: int = 0) -> bytes:
    return _TCMSG.pack(0, ifindex, handle, parent, info)


def htb_root(ifindex: int, default_minor: int, flags: int = CREATE) -> bytes:
    """``tc qdisc add dev X root handle 1: htb default <default_minor>``."""
    glob = struct.pack("=IIIII", 3, 10, default_minor, 0, 0)  # version, r2q, defcls, debug, direct_pkts
    body = _tcmsg(ifindex, tc_handle(1, 0), TC_H_ROOT) + attr_str(TCA_KIND, "htb")
    body += attr(TCA_OPTIONS, attr(TCA_HTB_INIT, glob))
    return message(RTM_NEWQDISC, flags, body)


def delete_root(ifindex: int) -> bytes:
    return message(RTM_DELQDISC, 0, _tcmsg(ifindex, 0, TC_H_ROOT))


def htb_burst_bytes(rate_bps: int, mtu: int = 1600) -> int:
    """Bucket size of a class: 1 ms at the rate plus one MTU (tc's formula at HZ=1000)."""
    return rate_bps // 8 // 1000 + mtu


def htb_class(ifindex: int, minor: int, rate_bps: int, flags: int = CREATE, ceil_bps: Optional[int] = None,
              parent_minor: int = 0) -> bytes:
    """``tc class add dev X parent 1:<parent_minor> classid 1:<minor> htb rate R ceil C``
    (ceil = rate unless given; parent 0 is the root qdisc ``1:``)."""
    rate_Bps = max(1, rate_bps // 8)
    ceil_Bps = rate_Bps if ceil_bps is None else max(1, ceil_bps // 8)
    ticks = int(1_000_000 * htb_burst_bytes(rate_bps) / rate_Bps * TICKS_PER_US)
    cticks = int(1_000_000 * htb_burst_bytes(ceil_Bps * 8) / ceil_Bps * TICKS_PER_US)
    quantum = min(max(rate_Bps // 10, 1600), 200_000)
    spec = _RATESPEC.pack(0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(rate_Bps, 0xFFFFFFFF))
    cspec = _RATESPEC.pack(0, TC_LINKLAYER_ETHERNET, 0, 0, 0, min(ceil_Bps, 0xFFFFFFFF))
    parms = spec + cspec + struct.pack("=IIIII", ticks, cticks, quantum, 0, 0)
    options = attr(TCA_HTB_PARMS, parms)
    if rate_Bps > 0xFFFFFFFF or ceil_Bps > 0xFFFFFFFF:
        options += attr(TCA_HTB_RATE64, struct.pack("=Q", rate_Bps))
        options += attr(TCA_HTB_CEIL64, struct.pack("=Q", ceil_Bps))
    body = _tcmsg(ifindex, tc_handle(1, minor), tc_handle(1, parent_minor)) + attr_str(TCA_KIND, "htb")
    return message(RTM_NEWTCLASS, flags, body + attr(TCA_OPTIONS, options))


def delete_class(ifindex: int, minor: int) -> bytes:
    return message(RTM_DELTCLASS, 0, _tcmsg(ifindex, tc_handle(1, minor), tc_handle(1, 0)))


IP_SRC_OFFSET, IP_DST_OFFSET = 12, 16  # of the addresses in an IPv4 header


def u32_handle(node: int) -> int:
    """Handle ``800::<node>`` in the root u32 hash table."""
    return (U32_ROOT_HT << 20) | node


def _u32_info(prio: int, protocol: int = ETH_P_IP) -> int:
    return (prio << 16) | socket.htons(protocol)


def u32_dst_filter(ifindex: int, node: int, dest_ip: str, minor: int, prio: int = 1,
                   flags: int = CREATE) -> bytes:
    """``tc filter add dev X parent 1: protocol ip prio P handle 800::N u32 match ip dst D/32 flowid 1:M``."""
    return _u32_ip_filter(ifindex, node, dest_ip, IP_DST_OFFSET, minor, prio, flags)


def u32_src_filter(ifindex: int, node: int, src_ip: str, minor: int, prio: int = 1,
                   flags: int = CREATE) -> bytes:
    """``tc filter add dev X parent 1: protocol ip prio P handle 800::N u32 match ip src S/32 flowid 1:M``."""
    return _u32_ip_filter(ifindex, node, src_ip, IP_SRC_OFFSET, minor, prio, flags)


def _u32_ip_filter(ifindex: int, node: int, ip: str, offset: int, minor: int, prio: int, flags: int) -> bytes:
    value = int(ipaddress.IPv4Address(ip))
    sel = struct.pack("=BBBxHHhhI", TC_U32_TERMINAL, 0, 1, 0, 0, 0, 0, 0)
    key = struct.pack("!II", 0xFFFFFFFF, value) + struct.pack("=ii", offset, 0)
    options = attr_u32(TCA_U32_CLASSID, tc_handle(1, minor)) + attr(TCA_U32_SEL, sel + key)
    body = _tcmsg(ifindex, u32_handle(node), tc_handle(1, 0), _u32_info(prio)) + attr_str(TCA_KIND, "u32")
    return message(RTM_NEWTFILTER, flags, body + attr(TCA_OPTIONS, options))


def u32_prefix_filter(ifindex: int, prefix: str, minor: int, prio: int, flags: int = CREATE) -> bytes:
    """``tc filter add dev X parent 1: protocol ip prio P u32 match ip dst PREFIX flowid 1:M``
    (the kernel numbers the filter in the hash table of its priority)."""
    net = ipaddress.IPv4Network(prefix)
    sel = struct.pack("=BBBxHHhhI", TC_U32_TERMINAL, 0, 1, 0, 0, 0, 0, 0)
    key = struct.pack("!II", int(net.netmask), int(net.network_address)) + struct.pack("=ii", 16, 0)
    options = attr_u32(TCA_U32_CLASSID, tc_handle(1, minor)) + attr(TCA_U32_SEL, sel + key)
    body = _tcmsg(ifindex, 0, tc_handle(1, 0), _u32_info(prio)) + attr_str(TCA_KIND, "u32")
    return message(RTM_NEWTFILTER, flags, body + attr(TCA_OPTIONS, options))


def u32_all_filter(ifindex: int, protocol: int, minor: int, prio: int, flags: int = CREATE) -> bytes:
    """``tc filter add dev X parent 1: protocol <protocol> prio P u32 match u32 0 0 flowid 1:M``
    (every packet of that link-layer protocol)."""
    sel = struct.pack("=BBBxHHhhI", TC_U32_TERMINAL, 0, 1, 0, 0, 0, 0, 0)
    key = struct.pack("!II", 0, 0) + struct.pack("=ii", 0, 0)
    options = attr_u32(TCA_U32_CLASSID, tc_handle(1, minor)) + attr(TCA_U32_SEL, sel + key)
    body = _tcmsg(ifindex, 0, tc_handle(1, 0), _u32_info(prio, protocol)) + attr_str(TCA_KIND, "u32")
    return message(RTM_NEWTFILTER, flags, body + attr(TCA_OPTIONS, options))


def delete_filters(ifindex: int, prio: int, protocol: int = ETH_P_IP) -> bytes:
    """``tc filter del dev X parent 1: protocol ip prio P u32``: every filter of that priority."""
    body = _tcmsg(ifindex, 0, tc_handle(1, 0), _u32_info(prio, protocol)) + attr_str(TCA_KIND, "u32")
    return message(RTM_DELTFILTER, 0, body)


def dst_prefix(keys: list[tuple[int, int, int]], offset: int = 16) -> Optional[str]:
    """The destination (``offset`` 12: the source) a u32 filter's keys match: ``a.b.c.d`` for
    one address, ``a.b.c.d/len`` for a prefix, None for anything else (several keys, another
    offset, a mask with holes)."""
    if len(keys) != 1 or keys[0][2] != offset:
        return None
    mask, value = keys[0][0], keys[0][1]
    length = bin(mask).count("1")
    if mask != (0xFFFFFFFF << (32 - length)) & 0xFFFFFFFF or value & ~mask & 0xFFFFFFFF:
        return None
    ip = socket.inet_ntoa(value.to_bytes(4, "big"))
    return ip if length == 32 else f"{ip}/{length}"


def delete_u32_filter(ifindex: int, node: int, prio: int = 1) -> bytes:
    body = _tcmsg(ifindex, u32_handle(node), tc_handle(1, 0), _u32_info(prio)) + attr_str(TCA_KIND, "u32")
    return message(RTM_DELTFILTER, 0, body)


def pfifo_leaf(ifindex: int, minor: int, limit_pkts: int, flags: int = REPLACE) -> bytes:
    """``tc qdisc replace dev X parent 1:<minor> handle <minor>: pfifo limit L``."""
    body = _tcmsg(ifindex, tc_handle(minor, 0), tc_handle(1, minor)) + attr_str(TCA_KIND, "pfifo")
    return message(RTM_NEWQDISC, flags, body + attr(TCA_OPTIONS, struct.pack("=I", limit_pkts)))


def delete_leaf(ifindex: int, minor: int) -> bytes:
    return message(RTM_DELQDISC, 0, _tcmsg(ifindex, tc_handle(minor, 0), tc_handle(1, minor)))


def netem_leaf(ifindex: int, minor: int, delay_ms: float, jitter_ms: float, loss_pct: float,
               limit_pkts: int, flags: int = REPLACE) -> bytes:
    """``tc qdisc replace dev X parent 1:<minor> handle <minor>: netem ...``, encoded by pyroute2."""
    from pyroute2 import IPBatch

    batch = IPBatch()
    batch.tc("replace", "netem", ifindex, tc_handle(minor, 0), parent=tc_handle(1, minor),
             delay=int(delay_ms * 1000), jitter=int(jitter_ms * 1000), loss=loss_pct, limit=limit_pkts)
    raw = bytes(batch.batch)
    body = raw[HDR.size:HDR.unpack_from(raw)[0]]
    return message(RTM_NEWQDISC, flags, body)


def veth_into_netns(host_ifname: str, bridge_index: int, peer_ifname: str, netns_fd: int,
                    peer_index: int = 0) -> list[bytes]:
    """``ip link add H master BR type veth peer name P netns NS`` (peer index chosen if given),
    then H up without IPv6 addresses (``addrgenmode none``): a bridge port needs none, and each
    one's duplicate address and router solicitations would be flooded to every other port (at
    1,000 nodes, millions of deliveries that slowed the shaping after creation by half)."""
    peer = IFINFO.pack(0, 0, peer_index, 0, 0) + attr_str(IFLA_IFNAME, peer_ifname)
    peer += attr_u32(IFLA_NET_NS_FD, netns_fd)
    linkinfo = attr_str(IFLA_INFO_KIND, "veth") + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer))
    body = IFINFO.pack(0, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, host_ifname)
    body += attr_u32(IFLA_MASTER, bridge_index) + attr(IFLA_LINKINFO, linkinfo)
    no_ipv6 = attr(IFLA_AF_SPEC, attr(socket.AF_INET6, attr(IFLA_INET6_ADDR_GEN_MODE, bytes([IN6_ADDR_GEN_MODE_NONE]))))
    named = IFINFO.pack(0, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, host_ifname)
    up = IFINFO.pack(0, 0, 0, IFF_UP, IFF_UP) + attr_str(IFLA_IFNAME, host_ifname)
    return [message(RTM_NEWLINK, CREATE, body), message(RTM_NEWLINK, 0, named + no_ipv6), message(RTM_NEWLINK, 0, up)]


def veth_pair(host_ifname: str, peer_ifname: str, netns_fd: int) -> list[bytes]:
    """``ip link add H type veth peer name P netns NS``: a routed pair, no bridge."""
    peer = IFINFO.pack(0, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, peer_ifname) + attr_u32(IFLA_NET_NS_FD, netns_fd)
    linkinfo = attr_str(IFLA_INFO_KIND, "veth") + attr(IFLA_INFO_DATA, attr(VETH_INFO_PEER, peer))
    body = IFINFO.pack(0, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, host_ifname) + attr(IFLA_LINKINFO, linkinfo)
    return [message(RTM_NEWLINK, CREATE, body)]


def delete_link(ifname: str) -> bytes:
    return message(RTM_DELLINK, 0, IFINFO.pack(0, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, ifname))


def link_up(index: int, txqlen: Optional[int] = None) -> bytes:
    body = IFINFO.pack(0, 0, index, IFF_UP, IFF_UP)
    if txqlen is not None:
        body += attr_u32(IFLA_TXQLEN, txqlen)
    return message(RTM_NEWLINK, 0, body)


def gso_max_size(index: int, size_bytes: int) -> bytes:
    """``ip link set dev I gso_max_size N``: the largest packet the stack hands the interface."""
    return message(RTM_NEWLINK, 0, IFINFO.pack(0, 0, index, 0, 0) + attr_u32(IFLA_GSO_MAX_SIZE, size_bytes))


def add_ipv4(index: int, address: str, prefixlen: int) -> bytes:
    packed = ipaddress.IPv4Address(address).packed
    body = _IFADDR.pack(socket.AF_INET, prefixlen, 0, 0, index)
    body += attr(IFA_LOCAL, packed) + attr(IFA_ADDRESS, packed)
    return message(RTM_NEWADDR, CREATE, body)


def default_route(index: int, gateway: str) -> bytes:
    """The default route via ``gateway`` on interface ``index``."""
    body = _RTMSG.pack(socket.AF_INET, 0, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST, 0)
    body += attr(RTA_GATEWAY, ipaddress.IPv4Address(gateway).packed) + attr_u32(RTA_OIF, index)
    return message(RTM_NEWROUTE, CREATE, body)


def route_via(dst: str, gateway: str, prefsrc: Optional[str] = None) -> bytes:
    """The route to network ``dst`` via ``gateway`` (replacing one there), from ``prefsrc`` if given."""
    net = ipaddress.IPv4Network(dst)
    body = _RTMSG.pack(socket.AF_INET, net.prefixlen, 0, 0, RT_TABLE_MAIN, RTPROT_BOOT, 0, RTN_UNICAST, 0)
    if net.prefixlen:
        body += attr(RTA_DST, net.network_address.packed)
    body += attr(RTA_GATEWAY, ipaddress.IPv4Address(gateway).packed)
    if prefsrc:
        body += attr(RTA_PREFSRC, ipaddress.IPv4Address(prefsrc).packed)
    return message(RTM_NEWROUTE, REPLACE, body)


@dataclass
class Failure:
    """One request the kernel refused."""

    position: int
    errno: int
    text: str

    def describe(self) -> str:
        extra = f" ({self.text})" if self.text else ""
        return f"{os.strerror(self.errno)}{extra}"


class RtnlSocket:
    """A NETLINK_ROUTE socket, in the host's namespace or in a named one."""

    def __init__(self, netns: Optional[str] = None) -> None:
        args = (socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self.sock = nsfs.socket_in(netns, *args) if netns else socket.socket(*args)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_SNDBUFFORCE, 4 * CHUNK_BYTES)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 4 * 1024 * 1024)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        self.sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        self.sock.bind((0, 0))
        self._seq = 0

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> "RtnlSocket":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, messages: Iterable[bytes]) -> list[Failure]:
        """Send every message, in order, in large buffers; return the ones the kernel refused.

        The kernel handles a buffer's requests one after another before the send
        returns, and goes on past a refused one, so the answers of each buffer are
        read right after it is sent.
        """
        failures: list[Failure] = []
        chunk: list[bytes] = []
        size = 0
        first = self._seq + 1
        position = 0
        for msg in messages:
            self._seq += 1
            chunk.append(msg[:8] + struct.pack("=I", self._seq) + msg[12:])
            size += len(msg)
            position += 1
            if size >= CHUNK_BYTES:
                self._send_and_collect(chunk, first, failures)
                chunk, size = [], 0
        if chunk:
            self._send_and_collect(chunk, first, failures)
        return failures

    def _replies(self) -> Iterator[tuple[bytes, int, int, int]]:
        """Every message the kernel sends from now on: (message, type, flags, seq)."""
        while True:
            data = self.sock.recv(1 << 20)
            offset = 0
            while offset + HDR.size <= len(data):
                length, kind, flags, seq, _ = HDR.unpack_from(data, offset)
                if length < HDR.size:
                    break
                yield data[offset:offset + length], kind, flags, seq
                offset += (length + 3) & ~3

    def index_of(self, ifname: str) -> Optional[int]:
        """The index of interface ``ifname`` in this socket's namespace; None when it has none.
        (Asked by netlink: ``if_nametoindex``'s ioctl has the kernel run modprobe for a name it
        does not know, twice per lookup as root, where modules can be loaded.)"""
        self._seq += 1
        seq = self._seq
        self.sock.sendall(link_by_name_request(ifname, seq))
        for msg, kind, _, got_seq in self._replies():
            if got_seq != seq:
                continue
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", msg, HDR.size)
                if -code == errno.ENODEV:
                    return None
                raise OSError(-code, f"{os.strerror(-code)}: interface {ifname}")
            return link_index(msg)
        return None  # pragma: no cover - the generator never ends

    def dump(self, request: bytes) -> list[bytes]:
        """Send one dump request and return every reply message (without the final DONE)."""
        self._seq += 1
        seq = self._seq
        self.sock.sendall(request[:8] + struct.pack("=I", seq) + request[12:])
        replies = []
        for msg, kind, _, got_seq in self._replies():
            if got_seq != seq:
                continue
            if kind == NLMSG_DONE:
                return replies
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", msg, HDR.size)
                if code:
                    raise OSError(-code, os.strerror(-code))
                return replies
            replies.append(msg)
        return replies  # pragma: no cover - the generator never ends

    def _send_and_collect(self, chunk: list[bytes], first: int, failures: list[Failure]) -> None:
        self.sock.sendall(b"".join(chunk))
        pending = {HDR.unpack_from(m)[3] for m in chunk}
        for msg, kind, flags, seq in self._replies():
            if kind == NLMSG_ERROR and seq in pending:
                pending.discard(seq)
                (code,) = struct.unpack_from("=i", msg, HDR.size)
                if code:
                    text = _ext_ack_text(msg, flags) if flags & NLM_F_ACK_TLVS else ""
                    failures.append(Failure(seq - first, -code, text))
                if not pending:
                    return


def parse_attrs(buf: bytes, offset: int = 0, end: Optional[int] = None) -> dict[int, bytes]:
    """The rtattrs of ``buf[offset:end]`` by type (nested ones are left as bytes)."""
    end = len(buf) if end is None else end
    found = {}
    while offset + 4 <= end:
        length, kind = struct.unpack_from("=HH", buf, offset)
        if length < 4:
            break
        found[kind & 0x7FFF] = buf[offset + 4:offset + length]
        offset += (length + 3) & ~3
    return found


@dataclass
class TcObject:
    """One qdisc, class or filter as the kernel reports it."""

    handle: int
    parent: int
    info: int
    kind: str
    options: bytes


def tc_dump(rtnl: "RtnlSocket", what: int, ifindex: int, parent: int = 0) -> list[TcObject]:
    """Dump the qdiscs (RTM_GETQDISC), classes (RTM_GETTCLASS) or filters (RTM_GETTFILTER) of one interface."""
    found = []
    for reply in rtnl.dump(message(what, NLM_F_DUMP, _tcmsg(ifindex, 0, parent))):
        _, index, handle, got_parent, info = _TCMSG.unpack_from(reply, HDR.size)
        if index != ifindex:
            continue
        attrs = parse_attrs(reply, HDR.size + _TCMSG.size)
        kind = attrs.get(TCA_KIND, b"").split(b"\0", 1)[0].decode()
        found.append(TcObject(handle, got_parent, info, kind, attrs.get(TCA_OPTIONS, b"")))
    return found


def htb_default_minor(options: bytes) -> Optional[int]:
    init = parse_attrs(options).get(TCA_HTB_INIT)
    return struct.unpack_from("=III", init)[2] if init else None


def htb_rate_bytes(options: bytes) -> Optional[int]:
    """A class's rate in bytes/s (the 64-bit attribute when the kernel sends one)."""
    attrs = parse_attrs(options)
    if TCA_HTB_RATE64 in attrs:
        return struct.unpack_from("=Q", attrs[TCA_HTB_RATE64])[0]
    if TCA_HTB_PARMS in attrs:
        return _RATESPEC.unpack_from(attrs[TCA_HTB_PARMS])[5]
    return None


def htb_ceil_bytes(options: bytes) -> Optional[int]:
    """A class's ceil in bytes/s (the 64-bit attribute when the kernel sends one)."""
    attrs = parse_attrs(options)
    if TCA_HTB_CEIL64 in attrs:
        return struct.unpack_from("=Q", attrs[TCA_HTB_CEIL64])[0]
    if TCA_HTB_PARMS in attrs:
        return _RATESPEC.unpack_from(attrs[TCA_HTB_PARMS], _RATESPEC.size)[5]
    return None


def u32_key(options: bytes) -> tuple[Optional[int], list[tuple[int, int, int]]]:
    """(classid, [(mask, value, offset)]) of a u32 filter node; classid None for hash tables.

    Decoded here because pyroute2 0.9 reads the u32 selector four bytes off.
    """
    opts = parse_attrs(options)
    if TCA_U32_CLASSID not in opts or TCA_U32_SEL not in opts:
        return None, []
    sel = opts[TCA_U32_SEL]
    keys = [struct.unpack_from("!II", sel, 16 + 16 * i) + struct.unpack_from("=i", sel, 24 + 16 * i)
            for i in range(sel[2])]
    return struct.unpack("=I", opts[TCA_U32_CLASSID][:4])[0], keys


def _ext_ack_text(msg: bytes, flags: int) -> str:
    """The kernel's extended-ack message text, if it sent one."""
    # header + error code + the request's header (NETLINK_CAP_ACK keeps only that)
    offset = HDR.size + 4 + HDR.size
    while offset + 4 <= len(msg):
        length, kind = struct.unpack_from("=HH", msg, offset)
        if length < 4:
            break
        if kind == NLMSGERR_ATTR_MSG:
            return msg[offset + 4:offset + length].split(b"\0", 1)[0].decode(errors="replace")
        offset += (length + 3) & ~3
    return ""


# statistics (telemetry) ----------------------------------------------------------------------
RTM_GETLINK = 18
RTM_NEWSTATS, RTM_GETSTATS = 92, 94
IFLA_STATS_LINK_64 = 1
TCA_STATS2 = 7
TCA_STATS_BASIC, TCA_STATS_QUEUE, TCA_STATS_PKT64 = 1, 3, 8
_U16x2 = struct.Struct("=HH")
_BASIC = struct.Struct("=QI")  # gnet_stats_basic: bytes, packets
_QUEUE = struct.Struct("=IIIII")  # gnet_stats_queue: qlen, backlog, drops, requeues, overlimits
_U64 = struct.Struct("=Q")
_STATS64_HEAD = struct.Struct("=8Q")  # rx/tx packets, rx/tx bytes, rx/tx errors, rx/tx dropped
_IF_STATS_MSG = struct.Struct("=BxxxiI")  # family, ifindex, filter_mask
_STATS_AT = HDR.size + _IF_STATS_MSG.size + 4  # rtnl_link_stats64 in an RTM_NEWSTATS of one attribute
CLASS_HEAD = struct.Struct("=IH18xI")  # nlmsghdr's length and type, tcmsg's handle (28 bytes)
HANDLE_AT = HDR.size + 8  # where a class message's handle sits


def _get_request(kind: int, flags: int, body: bytes, seq: int) -> bytes:
    """A request without an acknowledgement (a GET answers with its data, a dump with DONE)."""
    return HDR.pack(HDR.size + len(body), kind, flags | NLM_F_REQUEST, seq, 0) + body


def link_by_name_request(ifname: str, seq: int = 1) -> bytes:
    """``RTM_GETLINK`` of one interface by its name (its index and counters come back)."""
    return _get_request(RTM_GETLINK, 0, IFINFO.pack(0, 0, 0, 0, 0) + attr_str(IFLA_IFNAME, ifname), seq)


def stats_values(msg: bytes, offset: int, end: int) -> Optional[tuple[int, ...]]:
    """The first 8 counters of an RTM_NEWSTATS message holding IFLA_STATS_LINK_64: rx/tx
    packets, rx/tx bytes, rx/tx errors, rx/tx dropped."""
    if offset + _STATS_AT + _STATS64_HEAD.size > end:
        return None
    length, kind = _U16x2.unpack_from(msg, offset + _STATS_AT - 4)
    if kind != IFLA_STATS_LINK_64 or length < 4 + _STATS64_HEAD.size:
        return None
    return _STATS64_HEAD.unpack_from(msg, offset + _STATS_AT)


def stats2_offsets(msg: bytes, offset: int, end: int) -> Optional[tuple[int, int, int]]:
    """Where, relative to the message, a class message's TCA_STATS2 holds its basic, queue and
    64-bit packet statistics (attribute headers; -1 for one it lacks)."""
    pos = offset + HDR.size + _TCMSG.size
    while pos + 4 <= end:
        length, kind = _U16x2.unpack_from(msg, pos)
        if length < 4:
            break
        if kind & 0x7FFF == TCA_STATS2:
            found = {TCA_STATS_BASIC: -1, TCA_STATS_QUEUE: -1, TCA_STATS_PKT64: -1}
            inner, stop = pos + 4, pos + length
            while inner + 4 <= stop:
                ilen, ikind = _U16x2.unpack_from(msg, inner)
                if ilen < 4:
                    break
                if ikind & 0x7FFF in found:
                    found[ikind & 0x7FFF] = inner - offset
                inner += (ilen + 3) & ~3
            return found[TCA_STATS_BASIC], found[TCA_STATS_QUEUE], found[TCA_STATS_PKT64]
        pos += (length + 3) & ~3
    return None


def class_stats(msg: bytes, offset: int, end: int, offsets: Optional[tuple[int, int, int]] = None
                ) -> Optional[tuple[int, int, int, int, int, int]]:
    """(handle, bytes, packets, drops, overlimits, backlog_bytes) of an RTM_NEWTCLASS message at
    ``msg[offset:end]``, from its TCA_STATS2 (basic and queue statistics; 64-bit packets if sent).
    ``offsets``: ``stats2_offsets`` of the message, when the caller found them already."""
    offsets = offsets or stats2_offsets(msg, offset, end)
    if offsets is None:
        return None
    handle = _TCMSG.unpack_from(msg, offset + HDR.size)[2]
    basic, queue, pkt64 = offsets
    nbytes = packets = drops = over = backlog = 0
    if basic >= 0:
        nbytes, packets = _BASIC.unpack_from(msg, offset + basic + 4)
    if queue >= 0:
        _, backlog, drops, _, over = _QUEUE.unpack_from(msg, offset + queue + 4)
    if pkt64 >= 0:
        packets = _U64.unpack_from(msg, offset + pkt64 + 4)[0]
    return handle, nbytes, packets, drops, over, backlog


def link_stats_request(ifindex: int, seq: int = 1) -> bytes:
    """``RTM_GETSTATS`` of one interface's 64-bit counters."""
    return _get_request(RTM_GETSTATS, 0, _IF_STATS_MSG.pack(0, ifindex, 1 << (IFLA_STATS_LINK_64 - 1)), seq)


def link_index(msg: bytes, offset: int = 0) -> int:
    """The interface index of an RTM_NEWLINK message."""
    return IFINFO.unpack_from(msg, offset + HDR.size)[2]


def root_qdisc_request(ifindex: int, seq: int = 1) -> bytes:
    """``RTM_GETQDISC`` of an interface's root qdisc alone (its statistics sum its classes')."""
    return _get_request(RTM_GETQDISC, NLM_F_ECHO, _tcmsg(ifindex, 0, TC_H_ROOT), seq)  # echo: answered to us


def class_dump_request(ifindex: int, seq: int = 1) -> bytes:
    return _get_request(RTM_GETTCLASS, NLM_F_DUMP, _tcmsg(ifindex, 0, 0), seq)


def ifindex(netns: Optional[str], ifname: str) -> Optional[int]:
    """The index of interface ``ifname`` in namespace ``netns`` (the host's when None); None
    when it has none (a namespace that is not there: ``NotFound``)."""
    try:
        with RtnlSocket(netns) as sock:
            return sock.index_of(ifname)
    except OSError:
        return None
