"""Where a node sits in its run's learning structure, for the dashboard's topology panel.

``places(name, conf)`` reads node ``name``'s structure conf (what ``controller.confs.structures`` made and
``confs.json`` keeps) and returns its places: ``[{"layer": int, "up": name or None}]``, the
highest layer first. ``up`` is the node this place sends its model to:

- E-tree: one place per layer the node is on, ``up`` its parent there (None at the root);
- FL: the aggregator ``{"layer": 2, "up": None}``, a trainer ``{"layer": 1, "up": aggregator}``;
- ring all-reduce: ``{"layer": 1, "up": its successor in the ring}``;
- gossip (and anything unknown or malformed): no place, ``[]``.

The page lays the nodes out from these (a layered tree, a star, a circle in ring order).
"""
from __future__ import annotations

from typing import Any, Optional

MAX_LAYER = 64  # as the structure files allow


def _name(value: Any) -> Optional[str]:
    return value if isinstance(value, str) and 0 < len(value) <= 64 else None


def _layer(value: Any) -> Optional[int]:
    return value if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_LAYER else None


def places(name: str, conf: Any) -> list[dict[str, Any]]:
    """The places of node ``name``, whose structure conf is ``conf`` (see the module's docstring)."""
    if not isinstance(conf, dict):
        return []
    role = conf.get("role")
    if role == "etree" and isinstance(conf.get("positions"), list):
        out = []
        for position in conf["positions"]:
            layer = _layer(position.get("layer")) if isinstance(position, dict) else None
            if layer is not None:
                out.append({"layer": layer, "up": _name(position.get("parent"))})
        return sorted(out, key=lambda p: -p["layer"])
    if role == "fl_aggregator":
        return [{"layer": 2, "up": None}]
    if role == "fl_trainer" and _name(conf.get("aggregator")):
        return [{"layer": 1, "up": conf["aggregator"]}]
    ring = conf.get("ring")
    if role == "ring" and isinstance(ring, list) and len(ring) > 1:
        names = [_name(x) for x in ring]
        if name not in names:
            return []
        return [{"layer": 1, "up": names[(names.index(name) + 1) % len(names)]}]
    return []


def places_of(structure: Any) -> dict[str, list[dict[str, Any]]]:
    """Every node's places, from ``{name: structure conf}`` (a run's structure, or what
    ``confs.json`` holds: ``{name: {"structure": conf}}``)."""
    if not isinstance(structure, dict):
        return {}
    out = {}
    for name, conf in structure.items():
        if isinstance(conf, dict) and "structure" in conf and "role" not in conf:
            conf = conf["structure"]
        out[str(name)] = places(str(name), conf)
    return out
