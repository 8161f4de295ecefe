"""Packets of a capture file (classic pcap, as tcpdump writes), as columns.

The file header is read with dpkt; the records are walked once and the IPv4 fields
(addresses, protocol, ports) gathered with numpy from the captured bytes (snap length
128 holds them). Frame lengths are the wire lengths (Ethernet header included; a TCP frame larger than the
MTU, made by segmentation offload, counts the headers of every segment it leaves as), times
the capture's epoch timestamps. A record cut short at the end of the file (a capture
stopped mid-write) ends the read.
"""
from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from typing import Optional

import dpkt
import numpy as np

from worker.api.errors import ConfigError

LINK_OFFSETS = {1: 14, 113: 16, 101: 0, 12: 0}  # Ethernet, Linux cooked, raw IP: where IPv4 starts
ETHERTYPE_AT = {1: 12, 113: 14}
NANO_MAGICS = {0xA1B23C4D, 0x4D3CB2A1}


@dataclass
class Packets:
    """One column per field, one row per IPv4 packet (non-IPv4 frames are counted, not kept)."""
    time_s: np.ndarray  # epoch seconds
    length: np.ndarray  # wire length in bytes (every segment's headers of an offloaded frame)
    src: np.ndarray  # IPv4 source as uint32
    dst: np.ndarray
    proto: np.ndarray  # IP protocol number
    sport: np.ndarray  # 0 when not TCP or UDP
    dport: np.ndarray
    other_frames: int = 0
    other_bytes: int = 0
    segments: Optional[np.ndarray] = None  # wire packets each frame stands for (offload: more than 1)

    def __post_init__(self) -> None:
        if self.segments is None:
            self.segments = np.ones(self.time_s.size, np.int64)

    @classmethod
    def empty(cls) -> "Packets":
        z = np.zeros(0)
        return cls(z, z.astype(np.int64), *(z.astype(np.uint32) for _ in range(2)), z.astype(np.uint8),
                   z.astype(np.uint16), z.astype(np.uint16))

    def __len__(self) -> int:
        return int(self.time_s.size)

    @staticmethod
    def concat(parts: list["Packets"]) -> "Packets":
        if not parts:
            return Packets.empty()
        fields = ("time_s", "length", "src", "dst", "proto", "sport", "dport")
        out = Packets(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields),
                      segments=np.concatenate([p.segments for p in parts]))
        out.other_frames = sum(p.other_frames for p in parts)
        out.other_bytes = sum(p.other_bytes for p in parts)
        return out


def read_pcap(path: str, mtu: int = 1500) -> Packets:
    """The IPv4 packets of the pcap file at ``path``; ``mtu`` of the captured interface (a larger
    TCP frame was built by segmentation offload and is counted as the segments it became)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 24:
        if not data:
            return Packets.empty()
        raise ConfigError(f"{path}: not a pcap file (shorter than its header)")
    magic = struct.unpack("<I", data[:4])[0]
    try:
        header = dpkt.pcap.LEFileHdr(data[:24]) if magic in (0xA1B2C3D4, 0xA1B23C4D) else dpkt.pcap.FileHdr(data[:24])
    except dpkt.UnpackError:
        raise ConfigError(f"{path}: not a pcap file") from None
    if header.magic not in (0xA1B2C3D4, 0xA1B23C4D):
        raise ConfigError(f"{path}: not a pcap file (magic {magic:#x}; pcapng is not read)")
    little = magic in (0xA1B2C3D4, 0xA1B23C4D)
    divisor = 1e9 if header.magic in NANO_MAGICS else 1e6
    linktype = header.linktype
    if linktype not in LINK_OFFSETS:
        raise ConfigError(f"{path}: link type {linktype} is not read (Ethernet, Linux cooked or raw IP)")
    cap_of = struct.Struct("<I" if little else ">I").unpack_from
    offsets = array("q")  # where each record's header starts; its fields are gathered after, with numpy
    pos, end = 24, len(data)
    add = offsets.append
    while pos + 16 <= end:
        cap = cap_of(data, pos + 8)[0]
        if pos + 16 + cap > end:
            break  # cut short: the capture stopped mid-write
        add(pos)
        pos += 16 + cap
    if not offsets:
        return Packets.empty()
    heads = np.asarray(offsets, np.int64)
    words = np.frombuffer(data, "<u4" if little else ">u4", count=(end // 4))  # aligned views of the headers
    if heads.size and (heads % 4 == 0).all():
        idx = heads // 4
        secs, fracs, caps, lens = (words[idx + i].astype(np.int64) for i in range(4))
    else:  # records at odd offsets: each header field read where it is
        hdr = np.frombuffer(data, np.uint8)
        def field(i: int) -> np.ndarray:
            b = [hdr[heads + 4 * i + k].astype(np.int64) for k in range(4)]
            return (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24) if little else (b[0] << 24 | b[1] << 16 | b[2] << 8 | b[3])
        secs, fracs, caps, lens = (field(i) for i in range(4))
    offsets = heads + 16  # where each record's frame starts
    buf = np.frombuffer(data, np.uint8)
    off = offsets
    cap = caps
    length = lens
    time_s = secs.astype(np.float64) + fracs.astype(np.float64) / divisor
    ip = off + LINK_OFFSETS[linktype]
    at = ETHERTYPE_AT.get(linktype)
    is_v4 = cap >= (ip - off) + 20
    if at is not None:
        etype = (buf[np.minimum(off + at, end - 1)].astype(np.uint16) << 8) | buf[np.minimum(off + at + 1, end - 1)]
        is_v4 &= etype == 0x0800
    is_v4 &= (buf[np.minimum(ip, end - 1)] >> 4) == 4
    other = ~is_v4
    ip, off, cap, length, time_s = ip[is_v4], off[is_v4], cap[is_v4], length[is_v4], time_s[is_v4]

    def u32(at_: np.ndarray) -> np.ndarray:
        b = [buf[at_ + i].astype(np.uint32) for i in range(4)]
        return (b[0] << 24) | (b[1] << 16) | (b[2] << 8) | b[3]

    def u16(at_: np.ndarray) -> np.ndarray:
        return (buf[at_].astype(np.uint16) << 8) | buf[at_ + 1]

    proto = buf[ip + 9]
    ihl = (buf[ip] & 0x0F).astype(np.int64) * 4
    l4 = ip + ihl
    has_ports = ((proto == 6) | (proto == 17)) & ((l4 + 4) <= off + cap)
    l4 = np.where(has_ports, l4, ip)  # a safe index where there are no ports
    sport = np.where(has_ports, u16(l4), 0).astype(np.uint16)
    dport = np.where(has_ports, u16(l4 + 2), 0).astype(np.uint16)
    # segmentation offload: a TCP frame above the MTU leaves as MSS-sized segments, each with its
    # own headers (what the wire and the qdisc count): count those headers too
    link = LINK_OFFSETS[linktype]
    is_tcp = (proto == 6) & ((l4 + 13) <= off + cap)
    doff = np.where(is_tcp, (buf[np.where(is_tcp, l4 + 12, ip)] >> 4).astype(np.int64) * 4, 0)
    headers = link + ihl + doff
    big = is_tcp & (length > mtu + link) & (mtu + link > headers)
    segments = np.ones(length.size, np.int64)
    if big.any():
        mss = np.maximum(mtu + link - headers, 1)
        segments = np.where(big, -(-(length - headers) // mss), 1)
        length = length + (segments - 1) * headers
    out = Packets(time_s, length, u32(ip + 12), u32(ip + 16), proto.astype(np.uint8), sport, dport,
                  segments=segments)
    out.other_frames = int(other.sum())
    out.other_bytes = int(lens[other].sum())
    return out


def ip_int(address: str) -> int:
    """A dotted IPv4 address as the uint32 the packets carry."""
    a, b, c, d = (int(x) for x in address.split("."))
    return (a << 24) | (b << 16) | (c << 8) | d


def ip_str(value: int) -> str:
    v = int(value)
    return f"{v >> 24 & 255}.{v >> 16 & 255}.{v >> 8 & 255}.{v & 255}"
