"""The controller's side of node identity (see ``dml_app.runtime.auth`` for the scheme).

``RunKeys`` holds the run secret. It gives each node process its own secret (in
its environment, never on a command line), signs the controller's calls to a
node with a key only that node can check, tells which node signed a ``/print``
or ``/log`` call (the name is the one whose key verifies, whatever the message
says), and completes the structure confs it pushes: the pair keys of the nodes
each one exchanges messages with, sealed with the receiving node's own secret (a conf may cross
a LAN in plain HTTP; the secret only ever travels in an agent's pinned channel or locally), and
for an FL aggregator the sample count of every trainer from the trainers' dataset confs.
"""
from __future__ import annotations

from typing import Any, Callable, Container, Mapping
from urllib.parse import urlsplit

import requests

from dml_app.runtime import auth
from worker.api.errors import AuthError, ConfigError


def talking_pairs(confs: Mapping[str, Mapping[str, Any]]) -> set[tuple[str, str]]:
    """Sorted pairs of nodes that exchange messages: a node and every node it sends to
    directly (``connect``: linked peers, relays included) or end to end (``forward``'s
    destinations). Both ends of a pair get its key."""
    pairs = set()
    for name, conf in confs.items():
        for peer in [*conf.get("connect", {}), *conf.get("forward", {})]:
            if peer != name:
                pairs.add(tuple(sorted((name, str(peer)))))
    return pairs  # type: ignore[return-value]


class RunKeys:
    """The run secret and what the controller derives from it."""

    def __init__(self, run_secret: bytes | None = None) -> None:
        self._secret = run_secret or auth.new_run_secret()
        self._guard = auth.ReplayGuard()

    def node_secret(self, name: str) -> bytes:
        return auth.node_secret(self._secret, name)

    def env_for(self, name: str) -> dict[str, str]:
        """What a node process gets in its environment: its own secret."""
        return {auth.SECRET_ENV: self.node_secret(name).hex()}

    def pair_key(self, a: str, b: str) -> bytes:
        return auth.pair_key(self._secret, a, b)

    def complete_structure_confs(self, confs: dict[str, dict[str, Any]],
                                 dataset_conf: Callable[[str], Mapping[str, Any]]) -> None:
        """Add ``sealed_peer_keys`` to every conf (the pairs of ``talking_pairs``, each key sealed
        for the receiving node: ``auth.seal_pair_key``); to an FL
        aggregator's, ``trainer_samples`` (``train_samples`` of each trainer's dataset conf,
        read through ``dataset_conf(name)``); to each E-tree position, ``child_samples``
        (the most samples a child's subtree holds: what the child may claim at most)."""
        keys: dict[str, dict[str, str]] = {name: {} for name in confs}
        for a, b in talking_pairs(confs):
            key = self.pair_key(a, b)
            for me, peer in ((a, b), (b, a)):
                if me in keys:
                    keys[me][peer] = auth.seal_pair_key(self.node_secret(me), peer, key)
        counted: dict[str, int] = {}  # a leaf counts under every ancestor: read its conf once

        def train_samples(node: str) -> int:
            if node in counted:
                return counted[node]
            n = dataset_conf(node).get("train_samples")
            if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
                raise ConfigError(f"dataset conf of {node}, field 'train_samples': a positive whole number is "
                                  f"needed, got {n!r}")
            counted[node] = n
            return n

        positions = {(name, int(p["layer"])): p for name, conf in confs.items() if conf.get("role") == "etree"
                     for p in conf.get("positions", [])}

        def subtree(node: str, layer: int, depth: int = 0) -> int:
            if layer <= 1 or depth > len(positions):
                return train_samples(node)
            pos = positions.get((node, layer))
            if pos is None:
                raise ConfigError(f"E-tree: {node} has no position on layer {layer}")
            return sum(subtree(child, layer - 1, depth + 1) for child in pos.get("children", []))

        for name, conf in confs.items():
            conf.pop("peer_keys", None)  # never in clear, whatever a conf file held
            conf["sealed_peer_keys"] = keys[name]
            if conf.get("role") == "fl_aggregator":
                conf["trainer_samples"] = {t: train_samples(t) for t in conf.get("trainers", [])}
            for pos in conf.get("positions", []) if conf.get("role") == "etree" else []:
                pos["child_samples"] = {c: subtree(c, int(pos["layer"]) - 1) for c in pos.get("children", [])
                                        if c != name}

    def signer(self, names_by_address: Callable[[], Mapping[str, str]]) -> "NodeSigner":
        """A ``requests`` auth that signs each call for the node at the URL's ``host:port``."""
        return NodeSigner(self, names_by_address)

    def headers_for(self, name: str, method: str, target: str, body: bytes) -> dict[str, str]:
        """The signature of the controller's call ``method target`` to node ``name``."""
        key = auth.from_controller_key(self.node_secret(name))
        return auth.sign(key, auth.E2E, method, target, name, auth.CONTROLLER, body)

    def node_headers(self, name: str, method: str, target: str, body: bytes) -> dict[str, str]:
        """What node ``name`` sends to the controller (for tests and tools acting as a node)."""
        return auth.NodeKeys(name, self.node_secret(name)).controller_headers(method, target, body)

    def verify(self, headers: Mapping[str, str], method: str, target: str, body: bytes | Callable[[], bytes],
               known: Container[str], digest_first: bool = False) -> str:
        """The node that signed this call to the controller; AuthError otherwise. ``body`` may
        be a function: it is read only once the headers name a node of the run, or with
        ``digest_first`` only once the MAC over the headers' body hash (``auth.DIGEST``)
        verifies, and then it must have that hash."""
        lowered = {k.lower(): v for k, v in headers.items()}
        try:
            claim = auth.claimed(lowered, auth.E2E)
            if claim[0] not in known:
                raise auth.AuthFailed(f"no node {claim[0][:40]!r} in this run")
            key = auth.to_controller_key(self.node_secret(claim[0]))
            if not digest_first:
                data = body() if callable(body) else body
                return auth.check(key, claim, method, target, auth.CONTROLLER, auth.body_hash(data), self._guard)
            try:
                digest = bytes.fromhex(lowered.get(auth.DIGEST.lower(), ""))
            except ValueError:
                digest = b""
            if len(digest) != len(auth.body_hash(b"")):
                raise auth.AuthFailed(f"no body hash ({auth.DIGEST})")
            sender = auth.check(key, claim, method, target, auth.CONTROLLER, digest, self._guard)
            data = body() if callable(body) else body
            if not auth.compare_digest(auth.body_hash(data), digest):
                raise auth.AuthFailed("the body is not the one signed")
            return sender
        except auth.AuthFailed as e:
            raise AuthError(f"node calls must be signed with the node's own key: {e}") from None


class NodeSigner(requests.auth.AuthBase):
    """Signs the controller's requests to nodes (``Session.auth``)."""

    def __init__(self, keys: RunKeys, names_by_address: Callable[[], Mapping[str, str]]) -> None:
        self.keys = keys
        self.names_by_address = names_by_address

    def __call__(self, r: requests.PreparedRequest) -> requests.PreparedRequest:
        name = self.names_by_address().get(urlsplit(r.url or "").netloc)
        if name is not None:
            body = r.body or b""
            if isinstance(body, str):
                body = body.encode()
            if not isinstance(body, bytes):
                raise TypeError("only whole bodies can be signed, not streams")
            r.headers.update(self.keys.headers_for(name, r.method or "GET", r.path_url, body))
        return r
