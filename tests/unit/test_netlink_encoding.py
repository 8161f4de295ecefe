"""Our struct-packed netlink requests, decoded by pyroute2's own parsers (an independent check).

pyroute2 0.9 decodes the u32 selector (struct tc_u32_sel) four bytes off, so the
selector is parsed here by hand with ``parse_attrs`` and ``struct`` instead.
"""
import ipaddress
import socket
import struct

import pytest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.tcmsg import tcmsg

from worker.kernel import netlink as nl

NLMSG_HDR = 16
TCMSG = 20
TC_BODY = NLMSG_HDR + TCMSG  # where a tc message's attributes start

REQ_ACK = nl.NLM_F_REQUEST | nl.NLM_F_ACK
CREATE_EXCL = nl.NLM_F_CREATE | nl.NLM_F_EXCL


def decode(cls, data):
    msg = cls(data)
    msg.decode()
    return msg


def header(data):
    """(length, type, flags, seq, pid) of the nlmsghdr."""
    return struct.unpack_from("=IHHII", data)


def tc_options(data):
    """The nested attributes inside TCA_OPTIONS of a tc request."""
    return nl.parse_attrs(nl.parse_attrs(data, TC_BODY)[nl.TCA_OPTIONS])


# --- the netlink header of every request --------------------------------------------------------

@pytest.mark.parametrize("data,kind,extra_flags", [
    (nl.htb_root(7, 1), nl.RTM_NEWQDISC, CREATE_EXCL),
    (nl.htb_root(7, 1, flags=nl.REPLACE), nl.RTM_NEWQDISC, nl.NLM_F_CREATE | nl.NLM_F_REPLACE),
    (nl.htb_class(3, 0x10, 10**7), nl.RTM_NEWTCLASS, CREATE_EXCL),
    (nl.htb_class(3, 0x10, 10**7, flags=0), nl.RTM_NEWTCLASS, 0),
    (nl.u32_dst_filter(2, 0x2A, "10.77.1.9", 0x2A), nl.RTM_NEWTFILTER, CREATE_EXCL),
    (nl.pfifo_leaf(2, 0x11, 50), nl.RTM_NEWQDISC, nl.NLM_F_CREATE | nl.NLM_F_REPLACE),
    (nl.veth_into_netns("h", 5, "eth0", 9)[0], nl.RTM_NEWLINK, CREATE_EXCL),
    (nl.veth_into_netns("h", 5, "eth0", 9)[1], nl.RTM_NEWLINK, 0),
    (nl.veth_into_netns("h", 5, "eth0", 9)[2], nl.RTM_NEWLINK, 0),
    (nl.add_ipv4(2, "10.77.0.9", 16), nl.RTM_NEWADDR, CREATE_EXCL),
    (nl.delete_root(2), nl.RTM_DELQDISC, 0),
    (nl.delete_class(2, 0x11), nl.RTM_DELTCLASS, 0),
    (nl.delete_u32_filter(2, 0x11), nl.RTM_DELTFILTER, 0),
    (nl.delete_leaf(2, 0x11), nl.RTM_DELQDISC, 0),
    (nl.delete_link("etb-0-12"), nl.RTM_DELLINK, 0),
    (nl.link_up(4), nl.RTM_NEWLINK, 0),
])
def test_header(data, kind, extra_flags):
    length, got_kind, flags, seq, pid = header(data)
    assert length == len(data)
    assert len(data) % 4 == 0
    assert got_kind == kind
    assert flags == REQ_ACK | extra_flags
    assert (seq, pid) == (0, 0)  # filled in when sent


def test_flag_constants():
    assert (nl.CREATE, nl.REPLACE) == (0x600, 0x500)
    assert REQ_ACK == 0x5


# --- qdiscs, classes and filters, decoded by pyroute2 -------------------------------------------

@pytest.mark.parametrize("ifindex,default_minor", [(7, 1), (1, 0x10), (300, 0xFFF)])
def test_htb_root(ifindex, default_minor):
    data = nl.htb_root(ifindex, default_minor)
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (ifindex, 0x10000, 0xFFFFFFFF)
    assert m.get_attr("TCA_KIND") == "htb"
    init = m.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_INIT")
    assert init["defcls"] == default_minor
    assert init["version"] == 3 and init["rate2quantum"] == 10
    # and our own reader of dumps agrees
    assert nl.htb_default_minor(nl.parse_attrs(data, TC_BODY)[nl.TCA_OPTIONS]) == default_minor


@pytest.mark.parametrize("rate_bps,burst_us", [
    (10**6, 13_800),        # (125 + 1600) bytes at 125,000 B/s
    (10**7, 2_280),         # (1250 + 1600) bytes at 1,250,000 B/s
    (50 * 10**6, 1_256),    # (6250 + 1600) bytes at 6,250,000 B/s
    (10**10, 1_001.28),     # (1,250,000 + 1600) bytes at 1.25e9 B/s
])
def test_htb_class(rate_bps, burst_us):
    data = nl.htb_class(3, 0x10, rate_bps)
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (3, 0x10010, 0x10000)
    assert m.get_attr("TCA_KIND") == "htb"
    parms = m.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")
    assert parms["rate"] == parms["ceil"] == rate_bps // 8  # bytes/s
    assert parms["buffer"] == parms["cbuffer"]
    assert parms["buffer"] / nl.TICKS_PER_US == pytest.approx(burst_us, abs=1)
    assert m.get_attr("TCA_OPTIONS").get_attr("TCA_HTB_RATE64") is None
    assert nl.htb_rate_bytes(nl.parse_attrs(data, TC_BODY)[nl.TCA_OPTIONS]) == rate_bps // 8


def test_htb_class_buffer_in_kernel_ticks(monkeypatch):
    # /proc/net/psched "000003e8 00000040 000f4240": 1000/64 ticks per microsecond, as tc computes it
    monkeypatch.setattr(nl, "TICKS_PER_US", 1000 / 64)
    parms = decode(tcmsg, nl.htb_class(3, 0x10, 10**7)).get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")
    assert parms["buffer"] == parms["cbuffer"] == 35_625  # 2280 us * 15.625


@pytest.mark.parametrize("rate_bps,quantum", [(8_000, 1600), (10**7, 125_000), (10**9, 200_000)])
def test_htb_class_quantum(rate_bps, quantum):
    parms = decode(tcmsg, nl.htb_class(3, 0x10, rate_bps)).get_attr("TCA_OPTIONS").get_attr("TCA_HTB_PARMS")
    assert parms["quantum"] == quantum


@pytest.mark.parametrize("rate_bps,has_rate64", [
    (8 * 0xFFFFFFFF, False),        # exactly the 32-bit limit in bytes/s
    (8 * (0xFFFFFFFF + 1), True),
    (40 * 10**9, True),             # 5e9 bytes/s
    (100 * 10**9, True),
])
def test_htb_class_rate64(rate_bps, has_rate64):
    data = nl.htb_class(3, 0x10, rate_bps)
    rate_Bps = rate_bps // 8
    m = decode(tcmsg, data)
    opts = m.get_attr("TCA_OPTIONS")
    parms = opts.get_attr("TCA_HTB_PARMS")
    assert parms["rate"] == parms["ceil"] == min(rate_Bps, 0xFFFFFFFF)
    if has_rate64:
        assert opts.get_attr("TCA_HTB_RATE64") == rate_Bps
        assert opts.get_attr("TCA_HTB_CEIL64") == rate_Bps
        raw = tc_options(data)
        assert struct.unpack("=Q", raw[nl.TCA_HTB_RATE64])[0] == rate_Bps
        assert struct.unpack("=Q", raw[nl.TCA_HTB_CEIL64])[0] == rate_Bps
    else:
        assert opts.get_attr("TCA_HTB_RATE64") is None and opts.get_attr("TCA_HTB_CEIL64") is None
    assert nl.htb_rate_bytes(nl.parse_attrs(data, TC_BODY)[nl.TCA_OPTIONS]) == rate_Bps


@pytest.mark.parametrize("node,ip,minor,prio", [
    (0x2A, "10.77.1.9", 0x2A, 1),
    (0x10, "192.168.0.1", 0x10, 1),
    (0xFFF, "255.255.255.254", 0xFFF, 7),
    (0x11, "1.2.3.4", 0x20, 2),
])
def test_u32_dst_filter(node, ip, minor, prio):
    data = nl.u32_dst_filter(5, node, ip, minor, prio=prio)
    m = decode(tcmsg, data)
    assert m["index"] == 5
    assert m["handle"] == 0x80000000 | node
    assert m["parent"] == 0x10000
    assert m["info"] == (prio << 16) | socket.htons(0x0800)
    assert m.get_attr("TCA_KIND") == "u32"
    assert m.get_attr("TCA_OPTIONS").get_attr("TCA_U32_CLASSID") == 0x10000 | minor

    opts = tc_options(data)
    assert struct.unpack("=I", opts[nl.TCA_U32_CLASSID])[0] == 0x10000 | minor
    sel = opts[nl.TCA_U32_SEL]
    assert len(sel) == 16 + 16  # struct tc_u32_sel, then one struct tc_u32_key
    flags, offshift, nkeys = struct.unpack_from("=BBB", sel)
    assert (flags, offshift, nkeys) == (nl.TC_U32_TERMINAL, 0, 1)
    assert struct.unpack_from("=HHhhI", sel, 4) == (0, 0, 0, 0, 0)  # offmask, off, offoff, hoff, hmask
    mask, value = struct.unpack_from("!II", sel, 16)  # network byte order
    off, offmask = struct.unpack_from("=ii", sel, 24)
    assert mask == 0xFFFFFFFF
    assert value == int(ipaddress.IPv4Address(ip))
    assert sel[20:24] == socket.inet_aton(ip)
    assert (off, offmask) == (16, 0)  # the destination address in the IPv4 header
    # and our own reader of dumps agrees
    assert nl.u32_key(nl.parse_attrs(data, TC_BODY)[nl.TCA_OPTIONS]) == (
        0x10000 | minor, [(0xFFFFFFFF, int(ipaddress.IPv4Address(ip)), 16)])


def test_u32_key_of_a_hash_table_node():
    opts = nl.attr_u32(3, 0x800)  # TCA_U32_DIVISOR only, no classid or selector
    assert nl.u32_key(opts) == (None, [])


def test_delete_u32_filter():
    data = nl.delete_u32_filter(2, 0x11, prio=3)
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (2, 0x80000011, 0x10000)
    assert m["info"] == (3 << 16) | socket.htons(0x0800)
    assert m.get_attr("TCA_KIND") == "u32"


@pytest.mark.parametrize("minor,limit", [(0x11, 50), (0x10, 1), (0xFFF, 1_000_000)])
def test_pfifo_leaf(minor, limit):
    data = nl.pfifo_leaf(2, minor, limit)
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (2, minor << 16, 0x10000 | minor)
    assert m.get_attr("TCA_KIND") == "pfifo"
    assert m.get_attr("TCA_OPTIONS")["limit"] == limit
    assert struct.unpack("=I", nl.parse_attrs(data, TC_BODY)[nl.TCA_OPTIONS])[0] == limit


def test_netem_leaf():
    data = nl.netem_leaf(4, 0x11, 20, 5, 0.5, 100)
    m = decode(tcmsg, data)
    assert header(data)[2] == REQ_ACK | nl.NLM_F_CREATE | nl.NLM_F_REPLACE
    assert (m["index"], m["handle"], m["parent"]) == (4, 0x110000, 0x10011)
    assert m.get_attr("TCA_KIND") == "netem"
    opts = m.get_attr("TCA_OPTIONS")
    assert opts["limit"] == 100
    assert opts["loss"] == pytest.approx(0.005 * 0xFFFFFFFF, abs=1)
    assert opts["jitter"] * 4 == pytest.approx(opts["delay"], rel=1e-6)  # 5 ms vs 20 ms in ticks


@pytest.mark.parametrize("data,index,handle,parent", [
    (nl.delete_root(9), 9, 0, 0xFFFFFFFF),
    (nl.delete_class(9, 0x12), 9, 0x10012, 0x10000),
    (nl.delete_leaf(9, 0x12), 9, 0x120000, 0x10012),
])
def test_tc_deletes(data, index, handle, parent):
    m = decode(tcmsg, data)
    assert (m["index"], m["handle"], m["parent"]) == (index, handle, parent)
    assert m.get_attr("TCA_KIND") is None


# --- links and addresses ------------------------------------------------------------------------

def test_veth_into_netns():
    create, no_ipv6, up = nl.veth_into_netns("etb-0-12", 5, "eth0", 9, peer_index=2)
    added = decode(ifinfmsg, no_ipv6)
    assert added.get_attr("IFLA_IFNAME") == "etb-0-12" and not added["change"] & 1
    inet6 = added.get_attr("IFLA_AF_SPEC").get_attr("AF_INET6")
    assert inet6.get_attr("IFLA_INET6_ADDR_GEN_MODE") == 1  # none: no link-local address
    raised = decode(ifinfmsg, up)
    assert raised.get_attr("IFLA_IFNAME") == "etb-0-12" and raised["flags"] & 1 and raised["change"] & 1  # IFF_UP
    m = decode(ifinfmsg, create)
    assert m.get_attr("IFLA_IFNAME") == "etb-0-12"
    assert m.get_attr("IFLA_MASTER") == 5
    assert m["index"] == 0
    assert not m["flags"] & 1 and not m["change"] & 1  # down until it has lost its IPv6 addresses
    info = m.get_attr("IFLA_LINKINFO")
    assert info.get_attr("IFLA_INFO_KIND") == "veth"
    peer = info.get_attr("IFLA_INFO_DATA").get_attr("VETH_INFO_PEER")
    assert peer.get_attr("IFLA_IFNAME") == "eth0"
    assert peer.get_attr("IFLA_NET_NS_FD") == 9
    assert peer["index"] == 2


def test_veth_peer_index_defaults_to_kernel_choice():
    m = decode(ifinfmsg, nl.veth_into_netns("h", 5, "eth0", 9)[0])
    peer = m.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_DATA").get_attr("VETH_INFO_PEER")
    assert peer["index"] == 0


def test_delete_link_and_link_up():
    m = decode(ifinfmsg, nl.delete_link("etb-0-12"))
    assert m.get_attr("IFLA_IFNAME") == "etb-0-12" and m["index"] == 0
    m = decode(ifinfmsg, nl.link_up(4))
    assert (m["index"], m["flags"] & 1, m["change"] & 1) == (4, 1, 1)
    assert m.get_attr("IFLA_TXQLEN") is None
    assert decode(ifinfmsg, nl.link_up(4, txqlen=500)).get_attr("IFLA_TXQLEN") == 500


@pytest.mark.parametrize("index,address,prefixlen", [(2, "10.77.0.9", 16), (40, "192.168.3.4", 24),
                                                     (1, "10.0.0.1", 32)])
def test_add_ipv4(index, address, prefixlen):
    m = decode(ifaddrmsg, nl.add_ipv4(index, address, prefixlen))
    assert (m["index"], m["prefixlen"], m["family"]) == (index, prefixlen, socket.AF_INET)
    assert m.get_attr("IFA_LOCAL") == address
    assert m.get_attr("IFA_ADDRESS") == address


# --- attributes ---------------------------------------------------------------------------------

@pytest.mark.parametrize("payload,length", [
    (b"", 4), (b"a", 8), (b"ab", 8), (b"abc", 8), (b"abcd", 8), (b"abcde", 12), (b"x" * 100, 104),
])
def test_attr_padding(payload, length):
    packed = nl.attr(9, payload)
    assert len(packed) == length
    assert struct.unpack_from("=HH", packed) == (4 + len(payload), 9)  # length excludes the padding
    assert packed[4 + len(payload):] == b"\0" * (length - 4 - len(payload))
    assert nl.parse_attrs(packed) == {9: payload}


def test_parse_attrs_round_trip_of_several():
    attrs = {1: b"htb\0", 2: b"\x01\x02\x03", 5: b"", 7: struct.pack("=Q", 2**40)}
    packed = b"".join(nl.attr(k, v) for k, v in attrs.items())
    assert nl.parse_attrs(packed) == attrs
    nested = nl.attr(2, packed)
    assert nl.parse_attrs(nl.parse_attrs(nested)[2]) == attrs


def test_parse_attrs_offset_end_and_nested_flag():
    packed = b"HEAD" + nl.attr(1, b"a") + nl.attr(2, b"b") + nl.attr(3, b"c")
    assert nl.parse_attrs(packed, 4) == {1: b"a", 2: b"b", 3: b"c"}
    assert nl.parse_attrs(packed, 4, 4 + 16) == {1: b"a", 2: b"b"}
    assert nl.parse_attrs(nl.attr(0x8000 | 2, b"x")) == {2: b"x"}  # NLA_F_NESTED is masked off
    assert nl.parse_attrs(b"\x02\x00\x01\x00junk") == {}  # a length below 4 stops parsing


@pytest.mark.parametrize("text,packed", [("htb", b"\x08\x00\x01\x00htb\0"),
                                         ("pfifo", b"\x0a\x00\x01\x00pfifo\0\0\0")])
def test_attr_str(text, packed):
    assert nl.attr_str(1, text) == packed


def test_attr_u32():
    assert nl.attr_u32(3, 0x01020304) == struct.pack("=HHI", 8, 3, 0x01020304)


# --- small helpers ------------------------------------------------------------------------------

@pytest.mark.parametrize("rate_bps,burst", [
    (8_000_000, 2600), (10**9, 126_600), (8000, 1601), (7999, 1600), (10**7, 2850), (100 * 10**9, 12_501_600),
])
def test_htb_burst_bytes(rate_bps, burst):
    assert nl.htb_burst_bytes(rate_bps) == burst


def test_htb_burst_bytes_mtu():
    assert nl.htb_burst_bytes(8_000_000, mtu=9000) == 10_000


@pytest.mark.parametrize("major,minor,handle", [(1, 0, 0x10000), (1, 0x10, 0x10010), (0x11, 0, 0x110000),
                                                (0xFFFF, 0xFFFF, 0xFFFFFFFF)])
def test_tc_handle(major, minor, handle):
    assert nl.tc_handle(major, minor) == handle


@pytest.mark.parametrize("node,handle", [(0x10, 0x80000010), (0xFFF, 0x80000FFF), (1, 0x80000001)])
def test_u32_handle(node, handle):
    assert nl.u32_handle(node) == handle
