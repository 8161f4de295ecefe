"""Who sent a message: per-node secrets, pair keys, and signed requests.

The controller holds a run secret. Every key is a keyed BLAKE2b-256 hash
(``_blake2``, no OpenSSL in a node process) under it:

- a node's own secret: ``H(run secret, "node" | name)``, handed to the node in its
  environment when it starts (``EDGETB_NODE_SECRET``, hex);
- from it, one key per direction with the controller:
  ``H(node secret, "node->controller")`` and ``H(node secret, "controller->node")``;
- a pair key for two nodes that exchange messages: ``H(run secret, "pair" | a | b)``
  with the names sorted, pushed in each node's structure conf sealed (``sealed_peer_keys``):
  XOR ``H(node secret, "pair seal" | peer)``, so only that node opens it, with the secret that
  reached it when it started (through an agent's pinned HTTPS channel, or locally), never in
  clear on a network, whichever way the conf travels.

A signed request carries a sender name, a timestamp, a nonce and a MAC over
(method, target, destination, sender, timestamp, nonce, BLAKE2b of the body).
The receiver looks up the key of the named sender (none: refused), checks the
MAC, the clock window and that the nonce is new. So the sender's identity is
what the key proves, never what a message claims.

Headers: ``X-Edgetb-From``/``-Ts``/``-Nonce``/``-Sig`` (end to end: a relay passes
them on untouched), and ``X-Edgetb-Hop``/``-Hop-Ts``/``-Hop-Nonce``/``-Hop-Sig``
(this hop only, between linked nodes). A node's call to the controller also carries
the body's hash (``X-Edgetb-Digest``), so the MAC is checked before the body is read.
"""
from __future__ import annotations

import os
import threading
import time
from _blake2 import blake2b  # keyed BLAKE2b without loading libcrypto
from _operator import _compare_digest as compare_digest  # what hmac uses, without loading OpenSSL
from typing import Mapping, Optional

KEY_BYTES = 32
WINDOW_S = 300.0  # how far a signed timestamp may be from the receiver's clock
SECRET_ENV = "EDGETB_NODE_SECRET"
CONTROLLER = "controller"  # the controller's name as a sender or destination
E2E = ("X-Edgetb-From", "X-Edgetb-Ts", "X-Edgetb-Nonce", "X-Edgetb-Sig")
HOP = ("X-Edgetb-Hop", "X-Edgetb-Hop-Ts", "X-Edgetb-Hop-Nonce", "X-Edgetb-Hop-Sig")
ANSWER_SIG = "X-Edgetb-Answer-Sig"  # an answer's signature by the node that answered (see NodeKeys.answer_sig)
DIGEST = "X-Edgetb-Digest"  # hex body_hash of a signed call: its MAC is checked before the body is read


class AuthFailed(Exception):
    """A request whose signature does not prove its sender."""


def _h(key: bytes, *parts: str | bytes) -> bytes:
    data = b"\0".join(p.encode() if isinstance(p, str) else p for p in parts)
    return blake2b(data, key=key, digest_size=KEY_BYTES).digest()


def new_run_secret() -> bytes:
    return os.urandom(KEY_BYTES)


def node_secret(run_secret: bytes, name: str) -> bytes:
    return _h(run_secret, "edgetb node", name)


def to_controller_key(secret: bytes) -> bytes:
    """The key a node signs its calls to the controller with."""
    return _h(secret, "edgetb node->controller")


def from_controller_key(secret: bytes) -> bytes:
    """The key the controller signs its calls to a node with."""
    return _h(secret, "edgetb controller->node")


def pair_key(run_secret: bytes, a: str, b: str) -> bytes:
    if a == b:
        raise ValueError(f"no pair key of a node with itself ({a})")
    low, high = sorted((a, b))
    return _h(run_secret, "edgetb pair", low, high)


def _seal_pad(secret: bytes, peer: str) -> bytes:
    return _h(secret, "edgetb pair seal", peer)


def seal_pair_key(secret: bytes, peer: str, key: bytes) -> str:
    """``key`` (shared with ``peer``) sealed for the node whose own secret is ``secret``: hex."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a pair key has {KEY_BYTES} bytes")
    return bytes(a ^ b for a, b in zip(key, _seal_pad(secret, peer))).hex()


def body_hash(body: bytes) -> bytes:
    return blake2b(body, digest_size=32).digest()


def mac(key: bytes, method: str, target: str, dest: str, sender: str, ts: str, nonce: str, digest: bytes) -> str:
    """The signature of one request (``digest``: ``body_hash`` of its body)."""
    return _h(key, "edgetb request v1", method.upper(), target, dest, sender, ts, nonce, digest).hex()


def sign(key: bytes, names: tuple[str, str, str, str], method: str, target: str, dest: str, sender: str,
         body: bytes = b"", digest: Optional[bytes] = None) -> dict[str, str]:
    """Headers (named by ``names``: sender, ts, nonce, sig) that sign a request, and the body's
    hash (``DIGEST``), so that the receiver checks the signature before it reads the body."""
    ts, nonce = f"{time.time():.3f}", os.urandom(12).hex()
    digest = body_hash(body) if digest is None else digest
    sig = mac(key, method, target, dest, sender, ts, nonce, digest)
    return {names[0]: sender, names[1]: ts, names[2]: nonce, names[3]: sig, DIGEST: digest.hex()}


def claimed_digest(headers: Mapping[str, str]) -> bytes:
    """The body hash lower-cased ``headers`` claim (``DIGEST``); AuthFailed when there is none."""
    try:
        digest = bytes.fromhex(headers.get(DIGEST.lower(), ""))
    except ValueError:
        digest = b""
    if len(digest) != KEY_BYTES:
        raise AuthFailed(f"no body hash ({DIGEST})")
    return digest


class ReplayGuard:
    """Nonces seen within the clock window: a signed request is accepted once."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._seen: dict[str, float] = {}
        self._lock = threading.Lock()
        self._purged = time.time()

    def fresh(self, ts: str, nonce: str) -> None:
        try:
            t = float(ts)
        except ValueError:
            raise AuthFailed("bad timestamp") from None
        now = time.time()
        if not abs(now - t) <= self.window_s:  # (NaN fails too)
            raise AuthFailed(f"timestamp {ts} is more than {self.window_s:g}s from this host's clock")
        if not 8 <= len(nonce) <= 64:
            raise AuthFailed("bad nonce")
        with self._lock:
            if now - self._purged > self.window_s:
                self._seen = {n: seen for n, seen in self._seen.items() if now - seen <= 2 * self.window_s}
                self._purged = now
            if nonce in self._seen:
                raise AuthFailed("replayed request (nonce seen before)")
            self._seen[nonce] = now


def claimed(headers: Mapping[str, str], names: tuple[str, str, str, str]) -> tuple[str, str, str, str]:
    """(sender, ts, nonce, sig) from lower-cased ``headers``; AuthFailed when one is missing."""
    values = tuple(headers.get(n.lower(), "") for n in names)
    if not all(values):
        raise AuthFailed(f"unsigned request (needs {', '.join(names)})")
    return values  # type: ignore[return-value]


def check(key: bytes, claim: tuple[str, str, str, str], method: str, target: str, dest: str, digest: bytes,
          guard: ReplayGuard) -> str:
    """The sender of a claim signed with ``key``, once its MAC, clock and nonce pass."""
    sender, ts, nonce, sig = claim
    if not compare_digest(mac(key, method, target, dest, sender, ts, nonce, digest).encode(), sig.encode()):
        raise AuthFailed(f"bad signature for sender {sender!r}")
    guard.fresh(ts, nonce)
    return sender


class NodeKeys:
    """A node's side: its own secret and its pair keys; signs and checks its messages."""

    def __init__(self, name: str, secret: bytes, peer_keys: Optional[Mapping[str, bytes]] = None) -> None:
        if len(secret) < 16:
            raise ValueError("a node secret needs at least 16 bytes")
        self.name = name
        self._secret = secret
        self.to_controller = to_controller_key(secret)
        self.from_controller = from_controller_key(secret)
        self.peers: dict[str, bytes] = dict(peer_keys or {})
        self.guard = ReplayGuard()
        self.hop_guard = ReplayGuard()

    @classmethod
    def from_env(cls, name: str, environ: Mapping[str, str] = os.environ) -> Optional["NodeKeys"]:
        value = environ.get(SECRET_ENV, "")
        if not value:
            return None
        try:
            return cls(name, bytes.fromhex(value))
        except ValueError as e:
            raise ValueError(f"{SECRET_ENV} is not a valid node secret: {e}") from None

    def open_peer_keys(self, sealed: Mapping[str, str]) -> None:
        """``sealed_peer_keys`` of a structure conf: ``{peer: hex of seal_pair_key}``, opened
        with this node's own secret."""
        keys = {}
        for peer, value in sealed.items():
            try:
                box = bytes.fromhex(str(value))
            except ValueError:
                raise ValueError(f"the key for {str(peer)[:40]!r} is not hex") from None
            if len(box) != KEY_BYTES:
                raise ValueError(f"the key for {str(peer)[:40]!r} is not {KEY_BYTES} bytes")
            keys[str(peer)] = bytes(a ^ b for a, b in zip(box, _seal_pad(self._secret, str(peer)))).hex()
        self.set_peer_keys(keys)

    def set_peer_keys(self, keys: Mapping[str, str]) -> None:
        """The keys shared with peers, in clear: ``{peer: hex key}`` (``open_peer_keys``, tests)."""
        parsed = {}
        for peer, value in keys.items():
            key = bytes.fromhex(str(value))
            if len(key) != KEY_BYTES:
                raise ValueError(f"the key for {peer} is not {KEY_BYTES} bytes")
            parsed[str(peer)] = key
        self.peers = parsed

    # to and from the controller
    def controller_headers(self, method: str, target: str, body: bytes = b"") -> dict[str, str]:
        """The signature of a call to the controller, with the body's hash in ``DIGEST``."""
        return sign(self.to_controller, E2E, method, target, CONTROLLER, self.name, body)

    def check_controller(self, headers: Mapping[str, str], method: str, target: str, digest: bytes) -> None:
        claim = claimed(headers, E2E)
        if claim[0] != CONTROLLER:
            raise AuthFailed("this call is for the controller only")
        check(self.from_controller, claim, method, target, self.name, digest, self.guard)

    # between nodes
    def _peer_key(self, peer: str) -> bytes:
        key = self.peers.get(peer)
        if key is None:
            raise AuthFailed(f"{self.name} exchanges no messages with {peer!r}")
        return key

    def peer_headers(self, dest: str, method: str, path: str, digest: bytes) -> dict[str, str]:
        """End-to-end signature of a message for ``dest``'s ``path``."""
        return sign(self._peer_key(dest), E2E, method, path, dest, self.name, digest=digest)

    def hop_headers(self, hop: str, method: str, target: str, digest: bytes) -> dict[str, str]:
        """This hop's signature (to the linked node ``hop``, for the URL target actually called)."""
        return sign(self._peer_key(hop), HOP, method, target, hop, self.name, digest=digest)

    def answer_sig(self, asker: str, nonce: str, answer: bytes) -> str:
        """This node's signature of its ``answer`` to ``asker``'s message (``nonce``: the message's
        end-to-end nonce, so that an answer cannot be replayed to another message)."""
        return _h(self._peer_key(asker), "edgetb answer v1", self.name, asker, nonce, body_hash(answer)).hex()

    def check_answer(self, answerer: str, nonce: str, answer: bytes, sig: str) -> None:
        """That ``answer`` to this node's message ``nonce`` was signed by ``answerer``."""
        want = _h(self._peer_key(answerer), "edgetb answer v1", answerer, self.name, nonce, body_hash(answer)).hex()
        if not compare_digest(want.encode(), sig.encode()):
            raise AuthFailed(f"the answer of {answerer!r} is not signed by it")

    def check_peer(self, headers: Mapping[str, str], method: str, path: str, digest: bytes) -> str:
        """The node that signed this message end to end (for this node, this path)."""
        claim = claimed(headers, E2E)
        return check(self._peer_key(claim[0]), claim, method, path, self.name, digest, self.guard)

    def check_hop(self, headers: Mapping[str, str], method: str, target: str, digest: bytes) -> str:
        """The linked node that passed this message to this one."""
        claim = claimed(headers, HOP)
        return check(self._peer_key(claim[0]), claim, method, target, self.name, digest, self.hop_guard)
