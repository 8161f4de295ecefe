"""How a role's messages reach its peers: a ``Transport`` delivers a POST and returns the answer.

``HttpTransport`` is a node's: a POST to the destination when the two are linked, else to the
linked node that is its next hop, whose ``/relay`` passes the body on. Every message is signed
end to end with the pair key of its sender and its destination (a relay passes that signature on
untouched), and per hop with the pair key of the two linked nodes (``dml_app.runtime.auth``).

Roles of one process wired to each other without a network (tests of a protocol) use the
in-memory transport of ``dml_app.roles.memory``.
"""
from __future__ import annotations

from typing import Callable, Optional, Protocol
from urllib.parse import quote

from dml_app.runtime.auth import ANSWER_SIG, E2E, NodeKeys, body_hash
from dml_app.runtime.http import CONTROL_BODY_BYTES, request

TTL_HEADER = "X-Edgetb-Ttl"  # relays left before a message is dropped (loops cannot live)
MAX_RELAYS = 16


class Transport(Protocol):
    """Delivers a role's messages; ``expect_continue``: a large body waits for the peer's go-ahead
    (a role sets it once peers are likely to refuse from the headers)."""

    expect_continue: bool

    def post(self, hop: str, dest: str, path: str, body: bytes, content_type: str, timeout_s: float,
             retries: int = 1, ttl: int = MAX_RELAYS, signed: Optional[dict[str, str]] = None,
             answer_headers: Optional[dict[str, str]] = None) -> bytes:
        """POST ``body`` to ``path`` on ``dest`` through the linked node ``hop`` (``dest`` itself
        when linked); returns the answer's body, signed by ``dest``. Raises ``ConnectionError`` (or
        ``OSError``, ``AuthFailed``) when it is not delivered or is answered with an error.
        ``ttl``: relays left; ``signed``: the end-to-end signature of a message being relayed (its
        answer's signature, for its sender to check, then goes into ``answer_headers``)."""
        ...


class HttpTransport:
    """Signed HTTP to linked nodes (``connect``: linked node -> "ip:port"); an answer longer than
    ``answer_limit()`` bytes (by default a control message's) is refused unread. With
    ``expect_continue`` set (by a role whose peers may refuse from the headers), a large body
    to a linked node waits for the peer's ``100 Continue``: a wait for the peer to be scheduled,
    worth paying only when a refusal is likely."""

    def __init__(self, connect: dict[str, str], keys: Optional[NodeKeys],
                 answer_limit: Callable[[], int] = lambda: CONTROL_BODY_BYTES) -> None:
        self.connect, self.keys, self.answer_limit = connect, keys, answer_limit
        self.expect_continue = False

    def post(self, hop: str, dest: str, path: str, body: bytes, content_type: str, timeout_s: float,
             retries: int = 1, ttl: int = MAX_RELAYS, signed: Optional[dict[str, str]] = None,
             answer_headers: Optional[dict[str, str]] = None) -> bytes:
        keys = self.keys
        if keys is None:
            raise ConnectionError("this node has no keys to sign with")
        target = path if hop == dest else f"/relay?to={quote(dest)}&path={quote(path)}"
        digest = body_hash(body)
        sent: dict[str, str] = {}

        def headers() -> dict[str, str]:  # fresh nonces for each attempt
            e2e = signed if signed is not None else keys.peer_headers(dest, "POST", path, digest)
            sent.update(e2e)
            return {**e2e, **keys.hop_headers(hop, "POST", target, digest), TTL_HEADER: str(ttl)}

        got: dict[str, str] = {}
        status, answer = request("POST", f"http://{self.connect[hop]}{target}", body, content_type, timeout_s,
                                 retries, headers=headers, max_answer_bytes=self.answer_limit(), answer_headers=got,
                                 expect_continue=self.expect_continue and hop == dest
                                 and len(body) > CONTROL_BODY_BYTES)
        if status >= 400:
            raise ConnectionError(f"{status}: {answer[:200]!r}")
        sig = got.get(ANSWER_SIG.lower(), "")
        if signed is not None:  # relayed: its sender checks the answer
            if answer_headers is not None and sig:
                answer_headers[ANSWER_SIG] = sig
            return answer
        keys.check_answer(dest, sent[E2E[2]], answer, sig)
        return answer
