"""Our struct-packed netlink requests, decoded by pyroute2's own parsers (an independent check)."""
import socket
import struct

import pytest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from worker import netlink as nl


def decode(cls, data):
    msg = cls(data)
    msg.decode()
    return msg


def header(data):
    return struct.unpack_from("=IHHII", data)


def test_htb_root():
    data = nl.htb_root(7, 1)
    length, kind, flags, _, _ = header(data)
    assert length == len(data) and kind == nl.RTM_NEWQDISC
    assert flags & (nl.NLM_F_REQUEST | nl.NLM_F_ACK | nl.NLM_F_CREATE | nl.NLM_F_EXCL) == 0x605
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (7, 0x10000, nl.TC_H_ROOT)
    assert m.get_attr("TCA_KIND") == "htb"
    assert nl.htb_default_minor(nl.parse_attrs(data, 36)[nl.TCA_OPTIONS]) == 1


@pytest.mark.parametrize("rate_bps", [10**6, 10**7, 50 * 10**6, 10**10])
def test_htb_class(rate_bps):
    data = nl.htb_class(3, 0x10, rate_bps)
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (3, 0x10010, 0x10000)
    parms = m.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")
    assert parms["rate"] == parms["ceil"] == rate_bps // 8
    burst_ticks = int(1_000_000 * nl.htb_burst_bytes(rate_bps) / (rate_bps // 8) * nl.TICKS_PER_US)
    assert parms["buffer"] == parms["cbuffer"] == burst_ticks
    assert nl.htb_rate_bytes(nl.parse_attrs(data, 36)[nl.TCA_OPTIONS]) == rate_bps // 8


def test_htb_class_above_32_bits_uses_rate64():
    data = nl.htb_class(3, 0x10, 40 * 10**9)  # 5e9 bytes/s
    opts = nl.parse_attrs(nl.parse_attrs(data, 36)[nl.TCA_OPTIONS])
    assert struct.unpack("=Q", opts[nl.TCA_HTB_RATE64])[0] == 5 * 10**9
    assert nl.htb_rate_bytes(nl.parse_attrs(data, 36)[nl.TCA_OPTIONS]) == 5 * 10**9


def test_u32_filter():
    data = nl.u32_dst_filter(2, 0x2A, "10.77.1.9", 0x2A)
    m = decode(tcmsg, data)
    assert m["handle"] == 0x80000000 | 0x2A and m["parent"] == 0x10000
    assert m["info"] == (1 << 16) | socket.htons(0x0800)
    assert m.get_attr("TCA_KIND") == "u32"
    classid, keys = nl.u32_key(nl.parse_attrs(data, 36)[nl.TCA_OPTIONS])
    assert classid == 0x1002A
    assert keys == [(0xFFFFFFFF, int.from_bytes(socket.inet_aton("10.77.1.9"), "big"), 16)]


def test_pfifo_leaf_and_deletes():
    m = decode(tcmsg, nl.pfifo_leaf(2, 0x11, 50))
    assert (m["handle"], m["parent"], m.get_attr("TCA_KIND")) == (0x110000, 0x10011, "pfifo")
    assert struct.unpack_from("=I", nl.parse_attrs(nl.pfifo_leaf(2, 0x11, 50), 36)[nl.TCA_OPTIONS])[0] == 50
    assert header(nl.delete_class(2, 0x11))[1] == nl.RTM_DELTCLASS
    assert header(nl.delete_root(2))[1] == nl.RTM_DELQDISC
    assert decode(tcmsg, nl.delete_u32_filter(2, 0x11))["handle"] == 0x80000011


def test_veth_into_netns():
    m = decode(ifinfmsg, nl.veth_into_netns("etb-0-12", 5, "eth0", 9, peer_index=2))
    assert m.get_attr("IFLA_IFNAME") == "etb-0-12" and m.get_attr("IFLA_MASTER") == 5
    assert m["flags"] & 1 and m["change"] & 1
    assert m.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_KIND") == "veth"


def test_add_ipv4():
    m = decode(ifaddrmsg, nl.add_ipv4(2, "10.77.0.9", 16))
    assert (m["index"], m["prefixlen"], m["family"]) == (2, 16, socket.AF_INET)
    assert m.get_attr("IFA_LOCAL") == "10.77.0.9"


@pytest.mark.parametrize("payload,length", [(b"", 4), (b"a", 8), (b"abcd", 8), (b"abcde", 12)])
def test_attr_padding(payload, length):
    packed = nl.attr(9, payload)
    assert len(packed) == length and nl.parse_attrs(packed) == {9: payload}


@pytest.mark.parametrize("rate_bps,burst", [(8_000_000, 2600), (10**9, 126_600), (8000, 1601)])
def test_burst(rate_bps, burst):
    assert nl.htb_burst_bytes(rate_bps) == burst
