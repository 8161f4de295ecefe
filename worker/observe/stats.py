"""Reading one interface's counters and its tc classes' statistics, once per telemetry sample.

``StatsSocket`` keeps a NETLINK_ROUTE socket open in the interface's namespace. Each read
sends one buffer and reads the answers:

- an idle interface (its classes did not change at the last read) is asked for its counters
  and its root qdisc (two small messages); the classes are dumped only when the root's
  answer is not byte for byte the last one: every packet a class sends, drops or holds, and
  every time a class is throttled (its overlimits), is counted by the root too;
- a busy interface is asked for its counters and its class dump in one buffer (no root
  qdisc: it is likely busy still). When the dump is byte for byte the last one, nothing
  moved: the values stay and the next read probes again.

``ClassDecoder`` turns a class dump into the link values. The first dump is walked message
by message, and where each wanted class's counters sit is compiled into two
``struct.Struct`` per dump message buffer: one reads the fields that identify the messages
(length, type, class handle, attribute headers), the other the counters. A later dump of
the same layout is decoded with those two unpacks and one permutation into the classes'
slots; any difference (a class added or gone, 64-bit packet counts appearing) walks the
dump again.
"""
from __future__ import annotations

import errno
import os
import socket
import struct
from array import array
from dataclasses import dataclass
from operator import itemgetter
from typing import Callable, Optional

from worker.kernel import nsfs
from worker.kernel.netlink import (
                                   CLASS_HEAD, HANDLE_AT, HDR, NETLINK_ROUTE, NLMSG_DONE, NLMSG_ERROR, RTM_NEWSTATS, RTM_NEWTCLASS,
                                   SO_RCVBUFFORCE, class_dump_request, class_stats, link_by_name_request, link_index, link_stats_request,
                                   root_qdisc_request, stats2_offsets, stats_values,
                                   )

# The kernel fills a dump buffer up to the larger of a page (less its overhead, at most 8 KiB)
# and the largest read so far: reading a page at most keeps its allocations small.
RECV_BYTES = min(max(os.sysconf("SC_PAGE_SIZE"), 4096), 8192)
FIELDS = 5  # per class: bytes, packets, drops, overlimits, backlog bytes
MISSING = -1
STATS_SEQ, ROOT_SEQ, DUMP_SEQ = 1, 2, 3
_U32 = struct.Struct("=I")
_ERRNO = struct.Struct("=i")
_DONE = struct.Struct("=IHHIIi")  # nlmsghdr, then the dump's result


@dataclass(frozen=True)
class _Layout:
    """Where a dump's wanted counters sit, per message buffer of the dump."""

    sizes: tuple[int, ...]
    ids: tuple[struct.Struct, ...]  # reads the identifying fields of a buffer
    expected: tuple[tuple[int, ...], ...]  # what they read when the layout was learnt
    counters: tuple[struct.Struct, ...]  # reads the counters of a buffer, in offset order
    order: Callable[[tuple[int, ...]], tuple[int, ...]]  # all buffers' counters -> slot order


def _format(fields: list[tuple[int, str, int]]) -> tuple[str, list[int]]:
    """A struct format reading each ``(offset, code, tag)`` field in offset order (skipping what
    lies between), and the fields' tags in that order."""
    fmt, at, tags = ["="], 0, []
    for offset, code, tag in sorted(fields):
        if offset > at:
            fmt.append(f"{offset - at}x")
        fmt.append(code)
        at = offset + struct.calcsize("=" + code)
        tags.append(tag)
    return "".join(fmt), tags


# One layout object per distinct dump layout, shared by every interface whose dump has it (nodes
# with as many links have the same class handles, in the same order): a sample then goes through
# a few layouts, not one per node, and finds them in the processor's caches.
_SHARED: dict[tuple, _Layout] = {}
SHARED_LAYOUTS_MAX = 4096


def _shared_layout(sizes: tuple[int, ...], id_formats: tuple[str, ...], expected: tuple[tuple[int, ...], ...],
                   counter_formats: tuple[str, ...], where: tuple[int, ...]) -> _Layout:
    key = (sizes, id_formats, expected, counter_formats, where)
    layout = _SHARED.get(key)
    if layout is None:
        if len(_SHARED) >= SHARED_LAYOUTS_MAX:
            _SHARED.clear()
        layout = _SHARED[key] = _Layout(sizes, tuple(map(struct.Struct, id_formats)), expected,
                                        tuple(map(struct.Struct, counter_formats)), itemgetter(*where))
    return layout


class ClassDecoder:
    """Writes each wanted class's counters (``classes``: class handle -> its first slot in the
    values) from the message buffers of a class dump (see the module's text)."""

    def __init__(self, classes: dict[int, int]) -> None:
        self.classes = classes
        slots = sorted(classes.values())
        self.start = slots[0] if slots else 0
        # compiled decoding writes one slice: the classes' slots must follow each other
        self._compilable = bool(slots) and slots == list(range(self.start, self.start + FIELDS * len(slots), FIELDS))
        self.layout: Optional[_Layout] = None
        self.walks = 0  # dumps decoded message by message

    def decode(self, buffers: list[bytes], values: array) -> None:
        layout = self.layout
        if layout is not None and len(buffers) == len(layout.sizes):
            counters: tuple[int, ...] = ()
            for data, size, ids, expected, reader in zip(buffers, layout.sizes, layout.ids, layout.expected,
                                                         layout.counters):
                if len(data) != size or ids.unpack_from(data) != expected:
                    break
                counters += reader.unpack_from(data)
            else:
                values[self.start:self.start + len(counters)] = array("q", layout.order(counters))
                return
        self._walk(buffers, values)

    def _walk(self, buffers: list[bytes], values: array) -> None:
        """Decode every message; learn the layout when every wanted class was found."""
        self.walks += 1
        for at in self.classes.values():
            values[at:at + FIELDS] = array("q", [MISSING] * FIELDS)
        found: set[int] = set()
        ids, counters, expected, tags = [], [], [], []
        for data in buffers:
            id_fields: list[tuple[int, str, int]] = []
            counter_fields: list[tuple[int, str, int]] = []
            pos = 0
            while pos + CLASS_HEAD.size <= len(data):
                length, kind, handle = CLASS_HEAD.unpack_from(data, pos)
                if length < HDR.size or pos + length > len(data):
                    break
                at = self.classes.get(handle) if kind == RTM_NEWTCLASS else None
                if at is not None:
                    offsets = stats2_offsets(data, pos, pos + length)
                    decoded = class_stats(data, pos, pos + length, offsets) if offsets is not None else None
                    if decoded is not None:
                        values[at:at + FIELDS] = array("q", decoded[1:])
                    if offsets is not None and offsets[0] >= 0 and offsets[1] >= 0 and handle not in found:
                        found.add(handle)
                        slot = at - self.start
                        basic, queue, pkt64 = (pos + o if o >= 0 else -1 for o in offsets)
                        id_fields += [(pos, "I", 0), (pos + 4, "H", 0), (pos + HANDLE_AT, "I", 0), (basic, "I", 0),
                                      (queue, "I", 0)]  # length, type, handle, attribute headers
                        if pkt64 >= 0:
                            id_fields.append((pkt64, "I", 0))
                        packets = (pkt64 + 4, "Q") if pkt64 >= 0 else (basic + 12, "I")
                        counter_fields += [(basic + 4, "Q", slot), (*packets, slot + 1), (queue + 12, "I", slot + 2),
                                           (queue + 20, "I", slot + 3), (queue + 8, "I", slot + 4)]
                pos += (length + 3) & ~3
            id_format, _ = _format(id_fields)
            counter_format, order = _format(counter_fields)
            ids.append(id_format)
            expected.append(struct.unpack_from(id_format, data))
            counters.append(counter_format)
            tags += order
        if not self._compilable or found != set(self.classes):
            self.layout = None
            return
        where = [0] * len(tags)  # slot offset -> its place in the buffers' counters
        for place, tag in enumerate(tags):
            where[tag] = place
        self.layout = _shared_layout(tuple(len(d) for d in buffers), tuple(ids), tuple(expected), tuple(counters),
                                     tuple(where))


class StatsSocket:
    """An open NETLINK_ROUTE socket in one namespace that reads one interface's counters and
    the statistics of its tc classes ``classes`` (handle -> first of its 5 slots in the values
    given to ``read``); see the module's text. ``always_dump`` dumps and decodes every time."""

    def __init__(self, netns: Optional[str], ifname: str, classes: dict[int, int], always_dump: bool = False) -> None:
        args = (socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        self.sock = nsfs.socket_in(netns, *args) if netns else socket.socket(*args)
        self.ifname = ifname
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1024 * 1024)
            # an answer that never comes fails the read (EAGAIN) instead of hanging the sampler
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("=qq", 2, 0))
            self.sock.bind((0, 0))
            self.port = self.sock.getsockname()[0]
            self.sock.sendall(link_by_name_request(ifname))
            data = self._recv()
            kind = HDR.unpack_from(data)[1]
            if kind == NLMSG_ERROR:
                code = -_ERRNO.unpack_from(data, HDR.size)[0]
                raise OSError(code, f"{os.strerror(code)}: interface {ifname} in {netns or 'the host namespace'}")
        except BaseException:
            self.sock.close()
            raise
        self.ifindex = link_index(data)
        self.always_dump = always_dump
        self.decoder = ClassDecoder(classes)
        stats = link_stats_request(self.ifindex, STATS_SEQ)
        self._dump = class_dump_request(self.ifindex, DUMP_SEQ)
        self._probe = stats + root_qdisc_request(self.ifindex, ROOT_SEQ)
        self._stats_and_dump = stats + self._dump
        self._busy = always_dump  # the classes changed at the last read
        self._root: Optional[bytes] = None  # the root qdisc's answer at the last probe
        self._last: list[bytes] = []  # the message buffers of the last dump
        self.dumps = 0

    def close(self) -> None:
        self.sock.close()

    def _recv(self) -> bytes:
        data = self.sock.recv(RECV_BYTES)
        if len(data) < HDR.size or _U32.unpack_from(data)[0] > len(data):
            raise OSError(errno.EMSGSIZE, f"an answer about {self.ifname} was cut at {len(data)} bytes")
        return data

    def read(self, values: array) -> Optional[tuple[int, int, int, int, int]]:
        """Write each class's bytes, packets, drops, overlimits and backlog at its slots of
        ``values``, or leave them as the last read wrote them when nothing changed; return the
        interface's tx bytes, rx bytes, tx packets, rx packets and drops (tx + rx), or None when
        the kernel had none to give."""
        if self._busy:
            self.sock.sendall(self._stats_and_dump)
            counters, _ = self._answers(1)
            changed = self._read_dump(values)
            self._root = None  # not read: the next probe dumps once more, to learn it
        else:
            self.sock.sendall(self._probe)
            counters, root = self._answers(2)
            changed = False
            if root != self._root:
                self.sock.sendall(self._dump)
                changed = self._read_dump(values)  # unchanged: the root moved while this was busy
            self._root = root
        self._busy = changed or self.always_dump
        return counters

    def _answers(self, count: int) -> tuple[Optional[tuple[int, int, int, int, int]], Optional[bytes]]:
        """Read ``count`` answers: the interface's counters (None for an error), then (if asked)
        the root qdisc's answer as it came (an error when there is none)."""
        counters: Optional[tuple[int, int, int, int, int]] = None
        root: Optional[bytes] = None
        while count:
            data = self._recv()
            length, kind, _, seq, _ = HDR.unpack_from(data)
            if seq == STATS_SEQ:
                s = stats_values(data, 0, length) if kind == RTM_NEWSTATS else None
                counters = None if s is None else (s[3], s[2], s[1], s[0], s[6] + s[7])
            elif seq == ROOT_SEQ:
                root = data
            else:
                continue  # not an answer to this read
            count -= 1
        return counters, root

    def _read_dump(self, values: array) -> bool:
        """Read a class dump's buffers and decode them unless they are the last dump's; True if
        anything changed."""
        self.dumps += 1
        buffers = []
        while True:
            data = self._recv()
            kind = HDR.unpack_from(data)[1]
            if kind == NLMSG_ERROR:
                code = -_ERRNO.unpack_from(data, HDR.size)[0]
                raise OSError(code, f"{os.strerror(code)}: classes of {self.ifname}")
            if kind != NLMSG_DONE:
                buffers.append(data)
            if self._ends_dump(data):
                break
        changed = buffers != self._last
        if changed or self.always_dump:
            self.decoder.decode(buffers, values)
            self._last = buffers
        return changed

    def _ends_dump(self, data: bytes) -> bool:
        """True if a dump buffer ends with the dump's DONE message (this kernel sends it alone;
        one may append it to the last buffer of classes). Its header names this socket and the
        dump's sequence number, which no class message's last bytes do."""
        if len(data) < _DONE.size:
            return False
        length, kind, _, seq, pid, result = _DONE.unpack_from(data, len(data) - _DONE.size)
        if length != _DONE.size or kind != NLMSG_DONE or seq != DUMP_SEQ or pid != self.port:
            return False
        if result < 0:
            raise OSError(-result, f"{os.strerror(-result)}: classes of {self.ifname}")
        return True
