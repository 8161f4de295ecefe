"""Places for connections (worker.admission) and the sock_diag messages (worker.kernel.sockdiag):
the pure logic, as tables; the real sockets are the security tier's."""
import socket
import struct

import pytest

from worker.admission import Places, plain, trusted_uids
from worker.kernel import sockdiag


def test_an_untrusted_caller_holds_its_share_and_gets_places_back():
    places = Places(per_caller=2, total=100, trusted=frozenset({0}))
    nobody, node = ("uid", 65534), ("addr", "10.0.0.2")
    assert [places.take(nobody) for _ in range(3)] == [True, True, False]
    assert places.take(node) and places.take(node) and not places.take(node)  # a share per caller
    places.give_back(nobody)
    assert places.take(nobody) and not places.take(nobody)
    assert places.untrusted == 4


def test_trusted_uids_are_never_refused_and_do_not_count():
    places = Places(per_caller=1, total=1, trusted=frozenset({0, 1000}))
    assert all(places.take(("uid", 0)) for _ in range(50))
    assert places.take(("uid", 1000)) and places.take(("uid", 1000))
    assert places.untrusted == 0
    assert places.take(("uid", None))  # an unknown local caller is untrusted
    assert not places.take(("addr", "10.0.0.9"))  # the untrusted total is reached
    assert places.take(("uid", 0))  # root still has room
    for _ in range(51):
        places.give_back(("uid", 0))
    assert ("uid", 0) not in places.held


def test_streams_per_caller():
    places = Places(streams_per_caller=1, trusted=frozenset({0}))
    assert places.take_stream(("uid", 7)) and not places.take_stream(("uid", 7))
    assert places.take_stream(("uid", 0)) and places.take_stream(("uid", 0))
    assert places.take_stream(None)
    places.give_back_stream(("uid", 7))
    assert places.take_stream(("uid", 7))


def test_trusted_uids_and_plain_addresses():
    assert trusted_uids({"SUDO_UID": "1234"}) >= {0, 1234}
    assert 4321 not in trusted_uids({"SUDO_UID": "x4321"})
    assert plain("::ffff:127.0.0.1") == "127.0.0.1" and plain("::1") == "::1" and plain("node") == "node"


def test_a_sock_diag_request_names_the_exact_four_tuple():
    msg = sockdiag.request(("127.0.0.1", 40000), ("127.0.0.2", 3333), seq=9)
    length, kind, flags, seq, _ = struct.unpack_from("=IHHII", msg)
    assert (length, kind, flags, seq) == (len(msg), sockdiag.SOCK_DIAG_BY_FAMILY, sockdiag.NLM_F_REQUEST, 9)
    family, protocol = struct.unpack_from("=BB", msg, 16)
    assert (family, protocol) == (socket.AF_INET, socket.IPPROTO_TCP)
    sport, dport, src, dst = struct.unpack_from(">HH16s16s", msg, 24)
    assert (sport, dport, src[:4], dst[:4]) == (40000, 3333, bytes([127, 0, 0, 1]), bytes([127, 0, 0, 2]))
    assert struct.unpack_from("=III", msg, 24 + 36) == (0, sockdiag.INET_DIAG_NOCOOKIE, sockdiag.INET_DIAG_NOCOOKIE)
    six = sockdiag.request(("::1", 1), ("::1", 2))
    assert struct.unpack_from("=B", six, 16)[0] == socket.AF_INET6
    mapped = sockdiag.request(("::ffff:127.0.0.1", 1), ("127.0.0.1", 2))
    assert struct.unpack_from("=B", mapped, 16)[0] == socket.AF_INET  # looked up as IPv4
    with pytest.raises(ValueError, match="different address families"):
        sockdiag.request(("::1", 1), ("127.0.0.1", 2))


def _answer(state: int, uid: int, inode: int, seq: int = 1, kind: int = sockdiag.SOCK_DIAG_BY_FAMILY) -> bytes:
    body = struct.pack("=BBBB", socket.AF_INET, state, 0, 0) + bytes(sockdiag.SOCKID_BYTES) + \
        struct.pack("=IIIII", 0, 0, 0, uid, inode)
    return struct.pack("=IHHII", 16 + len(body), kind, 0, seq, 0) + body


@pytest.mark.parametrize("answer,owner", [
    (_answer(1, 65534, 77), sockdiag.SocketOwner(1, 65534, 77)),
    (_answer(8, 0, 0), sockdiag.SocketOwner(8, 0, 0)),
    (_answer(1, 5, 5, seq=2), None),  # another request's answer
    (struct.pack("=IHHII", 36, sockdiag.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -2) + bytes(16), None),
    (_answer(1, 5, 5)[:40], None),  # cut short
    (b"", None),
])
def test_a_sock_diag_answer_is_read(answer, owner):
    assert sockdiag.parse(answer) == owner
