"""All-reduce strategies: the spanning structure a ring's members average their models over.

``ring``: the members' ring order (reduce-scatter then all-gather, ``dml_app.roles.ring``).
The others are trees (each member sends its partial sum up to its parent, the root divides
by the member count, and the mean goes back down):

- ``star:<node>``: every member a child of ``<node>`` (the first member when ``<node>`` is
  not one of this formation's);
- ``binary_tree``: the members in order as a binary heap (the parent of the i-th is the
  ((i - 1) // 2)-th);
- ``site_tree``: a star inside each site (by default a node's worker host), the site's first
  member its master, and a binary tree over the masters (KungFu's BINARY_TREE_STAR).

A structure's ``digest`` names it: the members agree on it before they install it.

A ring passes chunks: ``split`` flattens the weights into one float64 vector cut into one chunk
per member, ``chunk_index`` says which chunk a member receives at each step of reduce-scatter
and all-gather, and ``join`` makes arrays of the finished chunks again.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import numpy as np

Weights = list[np.ndarray]
KINDS = ("ring", "star", "binary_tree", "site_tree")
DEFAULT = "ring"


class StructureError(ValueError):
    """A strategy name or structure that cannot be used."""


def parse(strategy: str, members: Optional[list[str]] = None) -> tuple[str, Optional[str]]:
    """(kind, the star's root or None); StructureError for anything else (a star's root must be
    one of ``members`` when they are given)."""
    if not isinstance(strategy, str):
        raise StructureError(f"a strategy is a string like 'ring' or 'star:n1', not {strategy!r}")
    kind, _, arg = strategy.partition(":")
    if kind not in KINDS:
        raise StructureError(f"unknown strategy {strategy!r}; known: ring, star:<node>, binary_tree, site_tree")
    if kind == "star":
        if not arg:
            raise StructureError(f"strategy {strategy!r}: a star names its root, like 'star:n1'")
        if members is not None and arg not in members:
            raise StructureError(f"strategy {strategy!r}: {arg} is not one of the ring's nodes")
        return kind, arg
    if arg:
        raise StructureError(f"strategy {strategy!r}: only a star takes a node (star:<node>)")
    return kind, None


@dataclass(frozen=True)
class Structure:
    """One strategy laid over one formation's members: ``parent`` of each member (None for the
    root; empty for a ring)."""

    strategy: str
    members: tuple[str, ...]
    parent: tuple[tuple[str, Optional[str]], ...] = ()

    @property
    def is_ring(self) -> bool:
        return not self.parent

    def parent_of(self, member: str) -> Optional[str]:
        return dict(self.parent).get(member)

    def children(self, member: str) -> list[str]:
        return [m for m, p in self.parent if p == member]

    @property
    def root(self) -> Optional[str]:
        return next((m for m, p in self.parent if p is None), None)

    def digest(self) -> str:
        """A short hash of the structure (strategy, members, parents)."""
        import hashlib  # (here: a node process starts without _hashlib)

        text = json.dumps({"strategy": self.strategy, "members": list(self.members),
                           "parent": [list(e) for e in self.parent]}, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def edges(self) -> list[tuple[str, str]]:
        """(sender, receiver) of every transfer one all-reduce makes."""
        if self.is_ring:
            n = len(self.members)
            return [(self.members[i], self.members[(i + 1) % n]) for i in range(n)] if n > 1 else []
        up = [(m, p) for m, p in self.parent if p is not None]
        return up + [(p, m) for m, p in up]


def _heap(nodes: list[str]) -> dict[str, Optional[str]]:
    return {m: (nodes[(i - 1) // 2] if i else None) for i, m in enumerate(nodes)}


def build(strategy: str, members: list[str], sites: Optional[dict[str, str]] = None) -> Structure:
    """``strategy`` over ``members`` (in ring order); ``sites``: member -> site, for site_tree."""
    kind, root = parse(strategy)
    members = list(members)
    if kind == "ring" or len(members) < 2:
        return Structure(strategy, tuple(members))
    if kind == "star":
        hub = root if root in members else members[0]
        parent = {m: (None if m == hub else hub) for m in members}
    elif kind == "binary_tree":
        parent = _heap(members)
    else:
        by_site: dict[str, list[str]] = {}
        for m in members:
            by_site.setdefault((sites or {}).get(m, "local"), []).append(m)
        masters = [group[0] for group in by_site.values()]
        parent = _heap(masters)
        for group in by_site.values():
            parent.update({m: group[0] for m in group[1:]})
    structure = Structure(strategy, tuple(members), tuple((m, parent[m]) for m in members))
    check(structure)
    return structure


def check(structure: Structure) -> None:
    """StructureError unless a tree has one root and every member reaches it without a cycle."""
    if structure.is_ring:
        return
    parent = dict(structure.parent)
    if set(parent) != set(structure.members) or len(parent) != len(structure.parent):
        raise StructureError(f"{structure.strategy}: the structure does not list every member once")
    roots = [m for m, p in parent.items() if p is None]
    if len(roots) != 1:
        raise StructureError(f"{structure.strategy}: a tree has one root, this one has {len(roots)}")
    for m in parent:
        seen, at = set(), m
        while parent[at] is not None:
            if at in seen or parent[at] not in parent:
                raise StructureError(f"{structure.strategy}: {m} does not reach the root (a cycle or an outsider)")
            seen.add(at)
            at = parent[at]


def estimated_time_s(structure: Structure, model_bytes: float, rate_bps: dict[tuple[str, str], float]) -> float:
    """The time one all-reduce of ``model_bytes`` takes over ``structure`` at the edge rates
    ``rate_bps`` (transfers of one step in parallel, each edge at its own rate)."""
    n = len(structure.members)
    if n < 2:
        return 0.0
    if structure.is_ring:
        step = max(model_bytes / n * 8 / rate_bps[e] for e in structure.edges())
        return 2 * (n - 1) * step
    done: dict[str, float] = {}

    def up(m: str) -> float:  # when m's partial sum reaches its parent
        if m not in done:
            ready = max([up(c) for c in structure.children(m)], default=0.0)
            p = structure.parent_of(m)
            done[m] = ready + (model_bytes * 8 / rate_bps[(m, p)] if p is not None else 0.0)
        return done[m]

    root = structure.root or structure.members[0]
    t_up = up(root)

    def down(m: str) -> float:  # the longest path from m down to a leaf
        return max([model_bytes * 8 / rate_bps[(m, c)] + down(c) for c in structure.children(m)], default=0.0)

    return t_up + down(root)


def candidates(members: list[str], sites: Optional[dict[str, str]] = None) -> list[str]:
    """The strategies worth comparing over ``members``."""
    out = ["ring", "binary_tree"] + [f"star:{m}" for m in members]
    if sites and len({sites.get(m, "local") for m in members}) > 1:
        out.append("site_tree")
    return out


def best_strategy(members: list[str], measured_bps: dict[tuple[str, str], float], sites: Optional[dict[str, str]],
                  model_bytes: float = 1.0) -> str:
    """The candidate with the least estimated time over the edge rates measured (an edge not
    measured: the fastest measured; ties: the first candidate). Every member computes the
    same from the same votes."""
    fastest = max(measured_bps.values(), default=1e9)

    def rate(edge: tuple[str, str]) -> float:
        return measured_bps.get(edge) or fastest

    best, best_t = "ring", float("inf")
    for strategy in candidates(members, sites):
        s = build(strategy, members, sites)
        t = estimated_time_s(s, model_bytes, {e: rate(e) for e in s.edges()})
        if t < best_t * (1 - 1e-9) or best_t == float("inf"):
            best, best_t = strategy, t
    return best


# the ring's chunks -------------------------------------------------------------------------------
def split(weights: Weights, n: int) -> list[np.ndarray]:
    """The weights as one float64 vector cut into ``n`` chunks (some may be empty)."""
    flat = np.concatenate([np.asarray(w, dtype=np.float64).ravel() for w in weights])
    return [chunk.copy() for chunk in np.array_split(flat, n)]


def join(chunks: list[np.ndarray], like: Weights) -> Weights:
    """Chunks back into arrays shaped and typed like ``like``."""
    flat = np.concatenate(chunks)
    out, at = [], 0
    for w in like:
        out.append(flat[at:at + w.size].reshape(w.shape).astype(w.dtype))
        at += w.size
    return out


def chunk_index(pos: int, n: int, phase: str, step: int) -> int:
    """Which chunk the member at ``pos`` receives from its predecessor at (phase, step)."""
    p = (pos - 1) % n
    return (p - step) % n if phase == "reduce" else (p + 1 - step) % n
