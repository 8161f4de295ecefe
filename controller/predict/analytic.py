"""The protocols' own arithmetic: bytes, messages, compute and transfer of one round, per node.

Bytes follow from the protocol (``payload``: the arrays' bytes, without framing):

- ring all-reduce (``dml_app.roles.ring``): the weights flattened into P elements and cut by
  ``np.array_split`` into N chunks; N - 1 reduce-scatter steps pass float64 partial sums, N - 1
  all-gather steps pass finished chunks in the model's dtype, so a node sends and receives
  about (N - 1)/N x P x (8 + itemsize) bytes (12 for float32) in 2(N - 1) messages;
- FL: the aggregator sends the model to K = max(1, round(trainer_fraction x T)) trainers and
  gets K back; a trainer, picked with probability K/T, gets one and sends one;
- gossip: one model per round to one out-neighbour; a node receives, on average, one model
  from each in-neighbour divided by that neighbour's out-degree.

- tree all-reduce strategies (``star:<node>``, ``binary_tree``, ``site_tree``): a member sends
  its float64 partial sum (8 P bytes) to its parent and the mean (itemsize x P) to each child;

A node on the path of another's message (a relay, where two nodes share no link) counts it as
received and sent, as its role does.

- E-tree (``dml_app.roles.etree``): a position's work is asked once per round of its parent
  position (``calls``: the product of the ``sync`` of every position above it); an aggregator
  position runs ``sync`` rounds, each the model down to every child and its answer back (in the
  model's dtype; a child that is the node itself is a direct call, no message). A node counts
  what crosses before its last round is recorded: its last answer up goes after it, so a
  non-root node's sent bytes lack one model. Per round of the node's lowest layer (how the
  node is timed): the run's bytes and the root's critical path (its ``sync`` rounds, each the
  slowest child's way down, work and way up) divided by that layer's rounds.
- gossip's received models: a node's last round refuses what comes once it has gathered, so the
  in-neighbour's last model is not received (R - 1 of R rounds' models, as a lockstep run has it).

Time: ``own_units`` = epochs x samples x training FLOPs per sample / cpu (this node's training;
the FLOPs from the model itself, ``model_graph``, else 6 a parameter),
``round_units`` the same on the round's critical path (a ring waits for its slowest member, an
FL round for its slowest trainer); ``transfer_s`` the critical path's transfers at the
configured rates, the TCP/IP and Ethernet headers the shaper counts included, plus the paths'
delays (an FL aggregator's access links shared by its K models); ``own_send_s`` this node's
own sending; ``steps`` the transfers one after another on the critical path (a ring's 2(N - 1)
steps, a tree's way up and down, FL's model out and back, gossip's one send), each of which
also costs a latency (the request, the handling, the wait for the slowest) that the
calibration measures once; ``host_contention``: the payload all nodes send in the round (which
the emulation host's cores serialise, copy and shape) times the node processes that share those
cores (``host_s_per_byte_node``, measured once: at 80 nodes on 2 cores it is most of an E-tree
round, and it grows as N squared).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from controller.confs.confs import next_hops
from controller.predict.features import Path, etree_positions, etree_rounds, path, paths, ring_structure, send_targets
from controller.predict.model_graph import DENSE_FLOPS_PER_WEIGHT, TRAIN_FLOPS_PER_FORWARD
from controller.predict.setting import Setting

PARTIAL_SUM_BYTES = 8  # ring reduce-scatter partial sums travel as float64
# What a shaped link carries per payload byte: a full TCP segment holds 1448 bytes (MTU 1500 less
# the IP and TCP headers with timestamps) and the shaper counts 1514 (the Ethernet header too).
WIRE_BYTES_PER_PAYLOAD_BYTE = 1514 / 1448


@dataclass
class Terms:
    """One node's analytic quantities per round (``unsupported``: why there are none)."""

    payload_sent_bytes: float = 0.0
    payload_recv_bytes: float = 0.0
    messages_sent: float = 0.0
    messages_recv: float = 0.0
    own_units: float = 0.0
    round_units: float = 0.0
    transfer_s: float = 0.0
    own_send_s: float = 0.0
    steps: float = 0.0  # transfers one after another on the round's critical path
    host_bytes: float = 0.0  # the payload every node sends in this node's round: the emulation host's work
    host_nodes: float = 0.0  # the node processes that share the host's cores

    @property
    def host_contention(self) -> float:
        """The host's work per round times the processes it is shared among (bytes x nodes)."""
        return self.host_bytes * self.host_nodes
    unsupported: Optional[str] = None
    flows: list[tuple[Path, float, float]] = field(default_factory=list)  # (path, payload bytes, messages)

    @property
    def messages(self) -> float:
        return self.messages_sent + self.messages_recv


def _units(setting: Setting, node: str) -> float:
    conf = setting.structure[node]
    if conf.get("role") == "fl_aggregator":
        return 0.0
    cpu = setting.topology.nodes[node].cpu or 1.0
    epochs = conf.get("epoch") or 0
    if conf.get("role") == "etree":  # the trainer position's epochs (none without one)
        epochs = next((p.get("epoch") or 0 for p in conf.get("positions") or [] if p.get("layer") == 1), 0)
    return float(epochs) * setting.samples.get(node, 0) * work_per_sample(setting) / cpu


def work_per_sample(setting: Setting) -> float:
    """Training FLOPs per sample: the model's own (``model_graph``), else a dense network's of its
    parameters (6 a parameter: 2 forward, 4 backward)."""
    return setting.flops_per_sample or TRAIN_FLOPS_PER_FORWARD * DENSE_FLOPS_PER_WEIGHT * setting.param_count


def wire_s(nbytes: float, rate_bps: float) -> float:
    """Seconds a shaped link at ``rate_bps`` takes to carry ``nbytes`` of payload, headers included."""
    return nbytes * WIRE_BYTES_PER_PAYLOAD_BYTE * 8.0 / rate_bps


def _send_s(nbytes: float, p: Path) -> float:
    return wire_s(nbytes, p.rate_bps) + p.delay_ms / 1000.0


def ring_chunk_sizes(param_count: int, n: int) -> list[int]:
    """The element counts of ``np.array_split`` of P elements into n chunks."""
    return [len(c) for c in np.array_split(np.empty(param_count, dtype=np.uint8), n)]


def _ring(setting: Setting, all_paths: dict[str, list[Path]], out: dict[str, Terms]) -> None:
    ring = [m for m in (next(iter(setting.structure.values())).get("ring") or setting.structure)]
    n, item = len(ring), setting.itemsize
    sizes = ring_chunk_sizes(setting.param_count, n)
    round_units = max(_units(setting, m) for m in ring)
    transfer = 0.0
    for phase, width, shift in (("reduce", PARTIAL_SUM_BYTES, 0), ("gather", item, 1)):
        for step in range(n - 1):  # each step waits for the slowest pass
            transfer += max(_send_s(sizes[(i + shift - step) % n] * width, all_paths[m][0])
                            for i, m in enumerate(ring))
    for i, m in enumerate(ring):
        sent = sum(PARTIAL_SUM_BYTES * sizes[(i - s) % n] + item * sizes[(i + 1 - s) % n] for s in range(n - 1))
        recv = sum(PARTIAL_SUM_BYTES * sizes[(i - s - 1) % n] + item * sizes[(i - s) % n] for s in range(n - 1))
        own = sum(_send_s(PARTIAL_SUM_BYTES * sizes[(i - s) % n], all_paths[m][0])
                  + _send_s(item * sizes[(i + 1 - s) % n], all_paths[m][0]) for s in range(n - 1))
        out[m] = Terms(sent, recv, 2.0 * (n - 1), 2.0 * (n - 1), _units(setting, m), round_units, transfer, own,
                       steps=2.0 * (n - 1), flows=[(all_paths[m][0], sent, 2.0 * (n - 1))])


def _tree(setting: Setting, all_paths: dict[str, list[Path]], out: dict[str, Terms]) -> None:
    """A tree strategy: float64 partial sums up to the parent, the mean in the model's dtype
    down to every child (in parallel)."""
    tree = ring_structure(setting)
    up_bytes, down_bytes = PARTIAL_SUM_BYTES * setting.param_count, float(setting.model_bytes)
    to = {m: {p.dst: p for p in all_paths[m]} for m in tree.members}
    round_units = max(_units(setting, m) for m in tree.members)
    done: dict[str, float] = {}

    def up(m: str) -> float:  # when m's partial sum has reached its parent
        if m not in done:
            ready = max([up(c) for c in tree.children(m)], default=0.0)
            parent = tree.parent_of(m)
            done[m] = ready + (_send_s(up_bytes, to[m][parent]) if parent else 0.0)
        return done[m]

    def down(m: str) -> float:  # the longest way from m's mean down to a leaf
        return max([_send_s(down_bytes, to[m][c]) + down(c) for c in tree.children(m)], default=0.0)

    def depth(m: str) -> int:
        return 1 + max([depth(c) for c in tree.children(m)], default=-1)

    root = tree.root or tree.members[0]
    transfer = up(root) + down(root)
    for m in tree.members:
        parent, children = tree.parent_of(m), tree.children(m)
        has_parent = 1.0 if parent else 0.0
        own = (_send_s(up_bytes, to[m][parent]) if parent else 0.0) + max(
            [_send_s(down_bytes, to[m][c]) for c in children], default=0.0)
        flows = ([(to[m][parent], up_bytes, 1.0)] if parent else []) + [(to[m][c], down_bytes, 1.0) for c in children]
        out[m] = Terms(has_parent * up_bytes + len(children) * down_bytes,
                       len(children) * up_bytes + has_parent * down_bytes, has_parent + len(children),
                       has_parent + len(children), _units(setting, m), round_units, transfer, own,
                       steps=2.0 * depth(root), flows=flows)


def _fl(setting: Setting, all_paths: dict[str, list[Path]], out: dict[str, Terms]) -> None:
    agg = next(n for n, c in setting.structure.items() if c.get("role") == "fl_aggregator")
    trainers = send_targets(setting, agg)
    k = max(1, round(float(setting.structure[agg].get("trainer_fraction") or 1.0) * len(trainers)))
    model = float(setting.model_bytes)
    spec = setting.topology.nodes[agg]
    out_s = max(_send_s(model, p) for p in all_paths[agg])
    in_s = max(_send_s(model, all_paths[t][0]) for t in trainers)
    if spec.uplink_bps:
        out_s = max(out_s, wire_s(k * model, spec.uplink_bps))
    if spec.downlink_bps:
        in_s = max(in_s, wire_s(k * model, spec.downlink_bps))
    round_units = max(_units(setting, t) for t in trainers)
    share = k / len(trainers)
    out[agg] = Terms(k * model, k * model, float(k), float(k), 0.0, round_units, out_s + in_s, out_s, steps=2.0,
                     flows=[(p, share * model, share) for p in all_paths[agg]])
    for t in trainers:
        out[t] = Terms(share * model, share * model, share, share, _units(setting, t), round_units,
                       out_s + in_s, _send_s(model, all_paths[t][0]), steps=2.0, flows=[(all_paths[t][0], share * model, share)])
    for node in setting.structure:  # standby trainers: idle until a policy adds them
        out.setdefault(node, Terms())


def _gossip(setting: Setting, all_paths: dict[str, list[Path]], out: dict[str, Terms]) -> None:
    model = float(setting.model_bytes)
    recv = {n: 0.0 for n in setting.structure}
    for node, mine in all_paths.items():
        rounds = float(setting.structure[node].get("sync") or 0)
        kept = (rounds - 1.0) / rounds if rounds > 1 else 1.0  # the last model is refused by a finished node
        for p in mine:
            if p.dst in recv:
                recv[p.dst] += kept / len(mine)
    for node, mine in all_paths.items():
        send = statistics.fmean([_send_s(model, p) for p in mine]) if mine else 0.0
        sent = 1.0 if mine else 0.0
        units = _units(setting, node)
        out[node] = Terms(sent * model, recv[node] * model, sent, recv[node], units, units, send, send, steps=sent,
                          flows=[(p, model / len(mine), 1.0 / len(mine)) for p in mine])


def _etree(setting: Setting, out: dict[str, Terms]) -> None:
    """E-tree: every position's calls, the root's critical path, each node's messages (see the
    module docstring), per round of the node's lowest layer."""
    model = float(setting.model_bytes)
    pos = etree_positions(setting)
    calls, rounds = etree_rounds(setting)
    members, hops_cache = set(setting.structure), {}

    def to(src: str, dst: str) -> Path:
        if dst not in hops_cache:
            hops_cache[dst] = next_hops(setting.topology, members, dst)
        return path(setting.topology, src, dst, hops_cache[dst])

    crit: dict[tuple[str, int], tuple[float, float, float]] = {}  # one call: (units, transfer s, steps)

    def critical(key: tuple[str, int]) -> tuple[float, float, float]:
        if key not in crit:
            node, layer = key
            if layer == 1:
                crit[key] = (_units(setting, node), 0.0, 0.0)
            else:
                ways = []
                for child in pos[key].get("children") or []:
                    u, t, st = critical((child, layer - 1))
                    if child != node:
                        t, st = t + _send_s(model, to(node, child)) + _send_s(model, to(child, node)), st + 2.0
                    ways.append((u, t, st))
                sync = float(pos[key].get("sync") or 1)
                crit[key] = tuple(sync * max((w[i] for w in ways), default=0.0) for i in range(3))  # type: ignore[assignment]
        return crit[key]

    root = next(k for k, p in pos.items() if p.get("parent") is None)
    total_u, total_t, total_steps = critical(root)
    sent = {n: 0.0 for n in setting.structure}
    recv = dict(sent)
    flows: dict[str, list[tuple[Path, float, float]]] = {n: [] for n in setting.structure}
    for (node, layer), p in pos.items():
        if layer == 1:
            continue
        n_rounds = calls[(node, layer)] * float(p.get("sync") or 1)
        for child in p.get("children") or []:
            if child == node:
                continue
            for a, b in ((node, child), (child, node)):
                sent[a] += n_rounds
                recv[b] += n_rounds
                flows[a].append((to(a, b), n_rounds))  # type: ignore[arg-type]
    for node, conf in setting.structure.items():
        layers = sorted(int(p["layer"]) for p in conf.get("positions") or [])
        r = rounds[node] or 1.0
        lost = 0.0 if (node, layers[-1]) == root else 1.0  # the last answer up goes after the last round
        lowest = (node, layers[0])
        own_send = 0.0 if layers[0] == 1 else critical(lowest)[1] / float(pos[lowest].get("sync") or 1)
        out[node] = Terms((sent[node] - lost) * model / r, recv[node] * model / r, (sent[node] - lost) / r,
                          recv[node] / r, _units(setting, node) if layers[0] == 1 else 0.0, total_u / r,
                          total_t / r, own_send, steps=total_steps / r, host_bytes=sum(sent.values()) * model / r,
                          flows=[(fp, n * model / r, n / r) for fp, n in flows[node]])  # type: ignore[misc]


def terms(setting: Setting) -> dict[str, Terms]:
    """Every node's analytic terms for one round."""
    all_paths = paths(setting)
    out: dict[str, Terms] = {}
    roles = {c.get("role") for c in setting.structure.values()}
    if roles == {"ring"}:
        (_ring if ring_structure(setting).is_ring else _tree)(setting, all_paths, out)
    elif "fl_aggregator" in roles:
        _fl(setting, all_paths, out)
    elif roles == {"gossip"}:
        _gossip(setting, all_paths, out)
    elif roles == {"etree"}:
        _etree(setting, out)
    else:
        why = f"no analytic model of {setting.algorithm!r}"
        return {n: Terms(unsupported=why) for n in setting.structure}
    _add_relays(out)
    host = sum(t.payload_sent_bytes for t in out.values())
    for t in out.values():
        t.host_bytes = t.host_bytes or host
        t.host_nodes = float(len(setting.structure))
    return out


def _add_relays(out: dict[str, Terms]) -> None:
    """A node on the path of another's message relays it: its role counts those bytes as
    received and sent."""
    relayed: list[tuple[str, float, float]] = []
    for t in out.values():
        for p, payload, messages in t.flows:
            relayed += [(src, payload, messages) for src, _ in p.links[1:]]
    for node, payload, messages in relayed:
        if node in out:
            t = out[node]
            t.payload_sent_bytes += payload
            t.payload_recv_bytes += payload
            t.messages_sent += messages
            t.messages_recv += messages


def link_bytes(rows_terms: list[tuple[Terms, float]]) -> dict[str, float]:
    """Bytes per round on every directed link ("src->dst"), from each node's flows and its framing
    per message (``rows_terms``: (terms, overhead bytes per message sent)); a relayed flow loads
    every link of its path."""
    out: dict[str, float] = {}
    for t, overhead in rows_terms:
        for p, payload, messages in t.flows:
            for src, dst in p.links:
                key = f"{src}->{dst}"
                out[key] = out.get(key, 0.0) + payload + messages * overhead
    return dict(sorted(out.items()))


def predict(t: Terms, rounds: float, calibration: dict[str, float]) -> dict[str, Optional[float]]:
    """The analytic predictions of one node from its terms, with the calibration measured once
    (``compute_s_per_unit``, ``latency_s_per_step``, ``overhead_sent_bytes_per_msg``,
    ``overhead_recv_bytes_per_msg``)."""
    if t.unsupported:
        return {}
    compute = calibration.get("compute_s_per_unit", 0.0)
    round_s = (compute * t.round_units + t.transfer_s + t.steps * calibration.get("latency_s_per_step", 0.0)
               + t.host_contention * calibration.get("host_s_per_byte_node", 0.0))
    return {"round_mean_s": round_s, "round_p95_s": round_s, "train_s": compute * t.own_units,
            "send_s": t.own_send_s, "total_s": rounds * round_s,
            "bytes_sent_per_round": t.payload_sent_bytes + t.messages_sent * calibration.get(
                "overhead_sent_bytes_per_msg", 0.0),
            "bytes_recv_per_round": t.payload_recv_bytes + t.messages_recv * calibration.get(
                "overhead_recv_bytes_per_msg", 0.0)}
