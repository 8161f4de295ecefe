"""The scenario: how the network and the nodes change while a run goes on (pure model).

A ``scenario.json`` lists events, each with one trigger (``"at": seconds`` since the run's
``/start``, or ``"at_round": {"node", "round"}``: when that node reports that round) and one
kind::

    {"seed": 1, "time_scale": 1.0, "events": [
      {"at": 20, "link": {"src": "n1", "dst": "n2", "bw": "1mbit", "both_ways": true}},
      {"at": 30, "link_down": ["n3", "n4"], "for": 20},
      {"at_round": {"node": "n1", "round": 5}, "crash": "n5"}]}

``load_scenario`` checks it against the topology (``worker.api.schema``: unknown fields with
a did-you-mean, unknown nodes, bad times, units, models) and ``resolve`` turns it into a
``Timeline``: a list of ``Step`` with every random draw made from ``seed`` (revocation
lifetimes, replacement delays), ``for`` expanded into a step that undoes the event. A trace
is one step that starts its replay (``controller.run.trace_replay``: the rate changes bin by bin
from then, not one step per row). Each kind of event has its rule in ``EVENTS``:
its parser and whether ``for`` may undo it. Nothing here does I/O but reading the scenario
and its trace files; the runner (``controller.run.scenario_runner``) applies the steps.

``time_scale`` multiplies the lifetimes drawn from a model in minutes: with 1/60 a
CM-DARE lifetime of 50 minutes becomes 50 seconds of experiment. Explicit times in seconds
(``at``, ``for``, ``{"at": [...]}`` lifetimes, replacement delays) are not scaled.
"""
from __future__ import annotations

import bisect
import dataclasses
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, NamedTuple, Optional, get_args

from controller.model.topology import MIN_MEM_BYTES, NAME_RE, Topology
from controller.model.traces import TRACE_SCHEMA, TraceFiles, replay_lines
from controller.model.units import human_rate, parse_percent, parse_rate_bps, parse_time_ms, parse_size_bytes
from worker.api.errors import ConfigError
from worker.api.schema import MAX_SECONDS, SEED, Field, Place, Schema, describe, read_object, refuse_unknown

MAX_EVENTS = 10_000
MAX_ROUND = 100_000
# the longest node name topology's NAME_RE allows (15: names end up in interface and cgroup names)
MAX_NAME_LEN = max(n for n in range(1, 256) if NAME_RE.fullmatch("n" * n))
NAME = Field(str, "a node name", max_len=MAX_NAME_LEN)
SECONDS = Field(float, "seconds", low=0, high=MAX_SECONDS)
POSITIVE_SECONDS = Field(float, "seconds", low=0, low_open=True, high=MAX_SECONDS)

EventKind = Literal["link", "link_down", "partition", "loss", "crash", "pause", "resume", "cpu", "memory",
                    "revocation", "background", "trace", "access", "availability"]
KINDS: tuple[EventKind, ...] = get_args(EventKind)  # what scenario.json's events say
TRIGGERS = ("at", "at_round")
StepKind = Literal["link", "block", "unblock", "loss", "crash", "pause", "resume", "limits", "revoke", "replace",
                   "background", "access", "trace"]
STEP_KINDS: tuple[StepKind, ...] = get_args(StepKind)  # what the runner applies (scenario.csv's event column)

AT_ROUND = Schema({"node": Field(str, "the node whose round triggers the event", required=True, max_len=MAX_NAME_LEN),
                   "round": Field(int, "the round number", required=True, low=1, high=MAX_ROUND)})
LINK = Schema({"src": Field(str, "the link's source node", required=True, max_len=MAX_NAME_LEN),
               "dst": Field(str, "the link's destination node", required=True, max_len=MAX_NAME_LEN),
               "bw": Field(str, "the new rate, such as '1mbit'", required=True, max_len=32),
               "both_ways": Field(bool, "the same change on dst -> src too", default=False),
               "delay": Field(str, "needs sch_netem", max_len=32), "jitter": Field(str, "needs sch_netem", max_len=32),
               "loss": Field((str, float), "netem loss on the link, e.g. '1%', needs sch_netem")})
LOSS = Schema({"src": Field(str, "the node whose packets are dropped", required=True, max_len=MAX_NAME_LEN),
               "dst": Field(str, "a node, or '*' for every other node", required=True, max_len=MAX_NAME_LEN),
               "percent": Field(float, "percent of packets dropped", required=True, low=0, high=100),
               "both_ways": Field(bool, "drop dst -> src too", default=False)})
CPU = Schema({"node": Field(str, "the node whose CPU limit changes", required=True, max_len=MAX_NAME_LEN),
              "cores": Field(float, "CPU cores", required=True, low=0, low_open=True, high=1024)})
MEMORY = Schema({"node": Field(str, "the node whose memory limit changes", required=True, max_len=MAX_NAME_LEN),
                 "mem": Field((str, int), "a size such as '256M'", required=True)})
REVOCATION = Schema({"nodes": Field(list, "the nodes revoked", required=True, items=NAME, min_items=1,
                                    max_items=10_000),
                     "lifetime": Field(dict, "a lifetime model", required=True),
                     "notice_s": Field(float, "seconds between SIGTERM and SIGKILL", default=0.0, low=0,
                                       high=3600),
                     "replace_after_s": Field(dict, "a delay model; absent: not replaced")})
BACKGROUND = Schema({"src": Field(str, "the node that sends the flow (iperf3 client)", required=True,
                                   max_len=MAX_NAME_LEN),
                     "dst": Field(str, "the node that receives it (iperf3 server)", required=True,
                                   max_len=MAX_NAME_LEN),
                     "rate": Field(str, "the flow's rate, such as '5mbit'", required=True, max_len=32),
                     "on_s": Field(float, "seconds on (with off_s: ON/OFF)", low=0, low_open=True, high=MAX_SECONDS),
                     "off_s": Field(float, "seconds off", low=0, low_open=True, high=MAX_SECONDS),
                     "for": Field(float, "seconds the flow lasts", required=True, low=0, low_open=True,
                                  high=MAX_SECONDS),
                     "protocol": Field(str, "the flow's transport", default="tcp", choices=("tcp", "udp"))})
TRACE = Schema({"src": Field(str, "the link's source node", required=True, max_len=MAX_NAME_LEN),
                "dst": Field(str, "the link's destination node", required=True, max_len=MAX_NAME_LEN),
                **TRACE_SCHEMA.fields,
                "file": Field(str, "a trace file beside the scenario: a recording in 'format'", required=True,
                              max_len=255),
                "format": dataclasses.replace(TRACE_SCHEMA.fields["format"], required=False, default="csv"),
                "loop": Field(bool, "from the start again at the recording's end (false: its last rate holds)",
                              default=False),
                "both_ways": Field(bool, "the same rates on dst -> src too", default=False)})
ACCESS = Schema({"node": Field(str, "the node whose access links change", required=True, max_len=MAX_NAME_LEN),
                 "uplink": Field(str, "its new access link out, e.g. '2mbit'", max_len=32),
                 "downlink": Field(str, "its new access link in, e.g. '2mbit'", max_len=32)})
AVAILABILITY = Schema({
    "file": Field(str, "a CSV beside the scenario: node,t_on_s,t_off_s (controller.model.availability)",
                  required=True, max_len=255),
    "mode": Field(str, "how a node leaves and returns: pause (frozen, thawed) or crash (killed, started again)",
                  default="pause", choices=("pause", "crash")),
    "time_scale": Field(float, "multiplies the file's times", default=1.0, low=0, low_open=True, high=1e6),
    "clients": Field(str, "names: the node column names nodes; pick: it names trace clients, each node plays one "
                     "drawn from the seed", default="names", choices=("names", "pick")),
    "nodes": Field(list, "with clients 'pick': the nodes that play clients (default: all)", items=NAME,
                   max_items=10_000)})
TOP = Schema({"seed": SEED, "time_scale": Field(float, "multiplies lifetimes drawn in minutes", default=1.0,
                                                low=0, low_open=True, high=1e6),
              "events": Field(list, "the timeline", required=True, max_items=MAX_EVENTS)})


@dataclass(frozen=True)
class Step:
    """One change to apply: ``at_s`` seconds after its trigger (the run's start, or the round
    ``after_round`` = (node, round) once reported). ``params`` is what the runner needs."""

    at_s: float
    kind: StepKind
    target: str          # what it acts on, for people: "n1->n2", "n5", "n1,n2|n3,n4"
    detail: str          # the change, for people: "1 Mbit/s", "SIGTERM, SIGKILL after 2s"
    params: dict[str, Any] = field(default_factory=dict)
    after_round: Optional[tuple[str, int]] = None
    event: int = 0       # index of the scenario event it comes from

    def planned(self) -> str:
        when = f"{self.at_s:.3f}s"
        return f"round {self.after_round[1]} of {self.after_round[0]} + {when}" if self.after_round else when


@dataclass
class Timeline:
    """Every step of a scenario, resolved, in trigger order."""

    steps: list[Step]
    seed: int
    time_scale: float
    source: str = "scenario"
    notes: list[str] = field(default_factory=list)  # draws that make no step (a lifetime past a day)

    @property
    def replays(self) -> list[Any]:
        """The recordings its ``trace`` steps replay (``controller.model.traces.Replay``)."""
        return [s.params["replay"] for s in self.steps if s.kind == "trace"]

    def timed(self) -> list[Step]:
        return sorted((s for s in self.steps if s.after_round is None), key=lambda s: (s.at_s, s.event))

    def by_round(self) -> dict[tuple[str, int], list[Step]]:
        out: dict[tuple[str, int], list[Step]] = {}
        for s in sorted((s for s in self.steps if s.after_round), key=lambda s: (s.at_s, s.event)):
            out.setdefault(s.after_round, []).append(s)  # type: ignore[arg-type]
        return out

    def render(self) -> list[str]:
        """The timeline as lines (``--dry-run``)."""
        lines = [f"{self.source}: {len(self.steps)} steps (seed {self.seed}, time_scale {self.time_scale:g})"]
        for s in self.timed() + [s for steps in self.by_round().values() for s in steps]:
            lines.append(f"  {s.planned():>28}  {s.kind:<10} {s.target:<20} {s.detail}")
            if s.kind == "trace":
                lines += [f"  {'':>28}  {'':<10} {line}" for line in replay_lines(s.params["replay"])]
        return lines + [f"  note: {n}" for n in self.notes]


# lifetime and delay models -----------------------------------------------------------------
def check_lifetime(model: Any, place: Place, nodes: int) -> dict[str, Any]:
    """``{"exponential": {"rate_per_min": r}}``, ``{"cdf": [[minutes, fraction], ...]}`` or
    ``{"at": [seconds, ...]}`` (one per node)."""
    name = _one_key(model, ("exponential", "cdf", "at"), place)
    value = model[name]
    here = place.at(name)
    if name == "exponential":
        return {"exponential": Schema({"rate_per_min": Field(float, "revocations per minute", required=True, low=0,
                                                             low_open=True, high=1e6)}).validate(value, here)}
    if name == "at":
        times = Field(list, items=SECONDS, min_items=nodes, max_items=nodes).check(value, place, "at", ConfigError)
        return {"at": times}
    rows = Field(list, items=Field(list, items=Field(float, low=0, high=1e9), min_items=2, max_items=2),
                 min_items=1, max_items=10_000).check(value, place, "cdf", ConfigError)
    last_m, last_f = 0.0, 0.0
    for i, (minutes, fraction) in enumerate(rows):
        if fraction > 1:
            raise ConfigError(f"{here}, row {i}: fraction {fraction:g} is above 1")
        if minutes < last_m or fraction < last_f or (i and minutes == last_m):
            raise ConfigError(f"{here}, row {i}: minutes must increase and fractions must not decrease")
        last_m, last_f = minutes, fraction
    if last_f != 1:
        raise ConfigError(f"{here}: the last fraction must be 1 (every server is revoked by then), got {last_f:g}")
    return {"cdf": rows}


def check_delay(model: Any, place: Place) -> dict[str, Any]:
    """``{"fixed": s}``, ``{"uniform": [a, b]}`` or ``{"exponential": {"mean_s": m}}``."""
    name = _one_key(model, ("fixed", "uniform", "exponential"), place)
    if name == "fixed":
        return {"fixed": SECONDS.check(model[name], place, "fixed", ConfigError)}
    if name == "uniform":
        pair = Field(list, items=SECONDS, min_items=2, max_items=2).check(model[name], place, "uniform", ConfigError)
        if pair[0] > pair[1]:
            raise ConfigError(f"{place.field('uniform')}: [a, b] needs a <= b, got {pair}")
        return {"uniform": pair}
    return {"exponential": Schema({"mean_s": Field(float, "mean seconds", required=True, low=0, low_open=True,
                                                   high=MAX_SECONDS)}).validate(model[name], place.at(name))}


def draw_lifetime_s(model: dict[str, Any], rng: random.Random, index: int, time_scale: float) -> float:
    """A lifetime in seconds of experiment (models in minutes are multiplied by ``time_scale``)."""
    if "at" in model:
        return float(model["at"][index])
    if "exponential" in model:
        minutes = rng.expovariate(model["exponential"]["rate_per_min"])
    else:
        minutes = cdf_inverse(model["cdf"], rng.random())
    return minutes * 60.0 * time_scale


def cdf_inverse(rows: list[list[float]], u: float) -> float:
    """The minutes at which the empirical CDF (linear between rows, from (0, 0)) reaches ``u``."""
    points = [(0.0, 0.0)] + [(float(m), float(f)) for m, f in rows]
    fractions = [f for _, f in points]
    i = max(1, bisect.bisect_left(fractions, u))
    (m0, f0), (m1, f1) = points[i - 1], points[min(i, len(points) - 1)]
    return m1 if f1 == f0 else m0 + (m1 - m0) * (u - f0) / (f1 - f0)


def draw_delay_s(model: dict[str, Any], rng: random.Random) -> float:
    if "fixed" in model:
        return float(model["fixed"])
    if "uniform" in model:
        a, b = model["uniform"]
        return rng.uniform(a, b)
    return rng.expovariate(1.0 / model["exponential"]["mean_s"])


# loading and resolving -------------------------------------------------------------------------
def load_scenario(path: str, topology: Topology) -> Timeline:
    """``path`` read, checked against ``topology`` and resolved; any problem: ``ConfigError``
    naming the file and the event."""
    data = read_object(path, ConfigError, '{"seed": 1, "events": [...]}')
    return resolve(data, topology, path, os.path.dirname(os.path.abspath(path)))


def resolve(data: Any, topology: Topology, source: str = "scenario", base_dir: Optional[str] = None) -> Timeline:
    """The scenario document checked and turned into steps (every draw made from its seed)."""
    top = TOP.validate(data, Place(source))
    seed = top["seed"] if top["seed"] is not None else 0
    rng = random.Random(seed)
    steps: list[Step] = []
    notes: list[str] = []
    files = TraceFiles(base_dir) if base_dir is not None else None  # each trace file read once
    for i, event in enumerate(top["events"]):
        place = Place(source).at(f"events[{i}]")
        steps += _event_steps(event, i, place, topology, rng, top["time_scale"], files, notes)
    return Timeline(steps, seed, top["time_scale"], source, notes)


def _one_key(data: Any, names: tuple[str, ...], place: Place) -> str:
    if not isinstance(data, dict):
        raise ConfigError(f"{place}: expected an object with one of {', '.join(names)}, got {describe(data)}")
    refuse_unknown(data, names, place)
    if len(data) != 1:
        raise ConfigError(f"{place}: needs exactly one of {', '.join(names)}, got {len(data)}")
    return next(iter(data))


def _node(topology: Topology, name: Any, place: Place, label: str) -> str:
    if name not in topology.nodes:
        from worker.api.schema import suggestion

        hint = suggestion(name, topology.nodes) if isinstance(name, str) else ""
        raise ConfigError(f"{place.field(label)}: unknown node {name!r}{hint.replace('valid fields', 'nodes')}")
    return name


def _parsed(parse: Callable[[Any], Any], text: Any, place: Place, label: str) -> Any:
    """``parse(text)``; its ConfigError names the field ``label`` at ``place``."""
    try:
        return parse(text)
    except ConfigError as e:
        raise ConfigError(f"{place.field(label)}: {e}") from None


def _link_pair(topology: Topology, src: str, dst: str, place: Place) -> None:
    if src == dst:
        raise ConfigError(f"{place}: a link needs two different nodes, got {src!r} twice")
    if (src, dst) not in topology.links:
        raise ConfigError(f"{place}: there is no link {src} -> {dst} in the topology")


def _base_shapes(topology: Topology, pairs: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The topology's shape of each pair, which a link event changes and its undo restores."""
    return [topology.links[p].shape.to_dict() for p in pairs]


def _arrow(src: str, dst: str, both_ways: bool) -> str:
    return f"{src}{'<->' if both_ways else '->'}{dst}"


@dataclass(frozen=True)
class EventContext:
    """One scenario event as its kind's parser sees it: where it is, its trigger and ``for``,
    and what every event of the scenario shares (topology, draws, notes, the trace folder)."""

    index: int
    place: Place  # the event: ``events[i]``
    kind: EventKind
    at_s: float
    after_round: Optional[tuple[str, int]]
    duration: Optional[float]  # ``for``: seconds until the event is undone
    topology: Topology
    rng: random.Random
    time_scale: float
    trace_files: Optional[TraceFiles]  # the scenario's directory's (None: no scenario file)
    notes: list[str]

    @property
    def here(self) -> Place:
        """The kind's value: ``events[i], link``."""
        return self.place.at(self.kind)

    @property
    def key(self) -> str:
        """What ties the steps of this event together in the runner (a block and its unblock)."""
        return f"e{self.index}"

    def node(self, name: Any, label: str, place: Optional[Place] = None) -> str:
        """``name`` when the topology has it (errors name ``label`` at ``place``, default ``here``)."""
        return _node(self.topology, name, self.here if place is None else place, label)

    def pairs(self, src: str, dst: str, both_ways: bool) -> list[tuple[str, str]]:
        """The topology's links ``src -> dst`` (and back when ``both_ways``)."""
        pairs = [(src, dst)] + ([(dst, src)] if both_ways else [])
        for a, b in pairs:
            _link_pair(self.topology, a, b, self.here)
        return pairs

    def step(self, dt: float, kind: StepKind, target: str, detail: str, params: dict[str, Any]) -> Step:
        """A step ``dt`` seconds after the event's trigger."""
        return Step(self.at_s + dt, kind, target, detail, params, self.after_round, self.index)

    def undone(self, step: Step, kind: StepKind, detail: str, params: dict[str, Any]) -> list[Step]:
        """``step``, then the step that undoes it ``for`` seconds later when the event says so."""
        return [step] + ([self.step(self.duration, kind, step.target, detail, params)]
                         if self.duration is not None else [])


LINK_EXTRAS = (("delay", "delay_ms", parse_time_ms), ("jitter", "jitter_ms", parse_time_ms),
               ("loss", "loss_pct", parse_percent))  # a link event's netem fields: its step's params
PROCESS_STEPS: dict[str, tuple[StepKind, str]] = {"crash": ("crash", "SIGKILL"), "pause": ("pause", "frozen"),
                                                  "resume": ("resume", "thawed")}


def _link(value: Any, ev: EventContext) -> list[Step]:
    v = LINK.validate(value, ev.here)
    src, dst = ev.node(v["src"], "src"), ev.node(v["dst"], "dst")
    pairs = ev.pairs(src, dst, v["both_ways"])
    rate = _parsed(parse_rate_bps, v["bw"], ev.here, "bw")
    extra = {name: _parsed(parse, v[k], ev.here, k) for k, name, parse in LINK_EXTRAS if v[k] is not None}
    base = _base_shapes(ev.topology, pairs)
    step = ev.step(0, "link", _arrow(src, dst, v["both_ways"]),
                   human_rate(rate) + "".join(f", {k} {x}" for k, x in extra.items()),
                   {"pairs": pairs, "rate_bps": rate, "base": base, **extra})
    return ev.undone(step, "link", "as in the topology", {"pairs": pairs, "rate_bps": None, "base": base})


def _link_down(value: Any, ev: EventContext) -> list[Step]:
    pair = Field(list, items=NAME, min_items=2, max_items=2).check(value, ev.place, ev.kind, ConfigError)
    a, b = (ev.node(n, ev.kind, ev.place) for n in pair)
    if a == b:
        raise ConfigError(f"{ev.place.field(ev.kind)}: needs two different nodes, got {a!r} twice")
    step = ev.step(0, "block", f"{a}<->{b}", "link down", {"groups": [[a], [b]], "key": ev.key})
    return ev.undone(step, "unblock", "link up", {"groups": [[a], [b]], "key": ev.key})


def _partition(value: Any, ev: EventContext) -> list[Step]:
    groups = Field(list, items=Field(list, items=NAME, min_items=1, max_items=10_000), min_items=2,
                   max_items=1000).check(value, ev.place, ev.kind, ConfigError)
    seen: set[str] = set()
    for n in (n for g in groups for n in g):
        ev.node(n, ev.kind, ev.place)
        if n in seen:
            raise ConfigError(f"{ev.place.field(ev.kind)}: node {n!r} is in two groups")
        seen.add(n)
    step = ev.step(0, "block", "|".join(",".join(g) for g in groups), f"partition into {len(groups)} groups",
                   {"groups": groups, "key": ev.key})
    return ev.undone(step, "unblock", "healed", {"groups": groups, "key": ev.key})


def _loss(value: Any, ev: EventContext) -> list[Step]:
    v = LOSS.validate(value, ev.here)
    src = ev.node(v["src"], "src")
    dsts = [n for n in ev.topology.nodes if n != src] if v["dst"] == "*" else [ev.node(v["dst"], "dst")]
    if src in dsts:
        raise ConfigError(f"{ev.here.field('dst')}: loss needs two different nodes")
    flows = [(src, d) for d in dsts] + ([(d, src) for d in dsts] if v["both_ways"] else [])
    step = ev.step(0, "loss", _arrow(src, v["dst"], v["both_ways"]), f"{v['percent']:g}%",
                   {"flows": flows, "percent": v["percent"], "key": ev.key})
    return ev.undone(step, "loss", "0%", {"flows": flows, "percent": 0.0, "key": ev.key})


def _process(value: Any, ev: EventContext) -> list[Step]:
    """A crash, pause or resume of one node's process."""
    node = ev.node(NAME.check(value, ev.place, ev.kind, ConfigError), ev.kind, ev.place)
    kind, detail = PROCESS_STEPS[ev.kind]
    return ev.undone(ev.step(0, kind, node, detail, {"node": node}), "resume", "thawed", {"node": node})


def _cpu(value: Any, ev: EventContext) -> list[Step]:
    v = CPU.validate(value, ev.here)
    node = ev.node(v["node"], "node")
    before = ev.topology.nodes[node].cpu
    step = ev.step(0, "limits", node, f"cpu {v['cores']:g} cores", {"node": node, "cpu": v["cores"]})
    return ev.undone(step, "limits", f"cpu {before:g} cores" if before else "cpu unlimited",
                     {"node": node, "cpu": before})


def _memory(value: Any, ev: EventContext) -> list[Step]:
    v = MEMORY.validate(value, ev.here)
    node = ev.node(v["node"], "node")
    mem = _parsed(parse_size_bytes, v["mem"], ev.here, "mem")
    if mem < MIN_MEM_BYTES:
        raise ConfigError(f"{ev.here.field('mem')}: at least 4M, got {v['mem']!r}")
    before = ev.topology.nodes[node].mem_bytes
    step = ev.step(0, "limits", node, f"memory {mem} bytes", {"node": node, "mem_bytes": mem})
    return ev.undone(step, "limits", f"memory {before} bytes" if before else "memory unlimited",
                     {"node": node, "mem_bytes": before})


def _revocation(value: Any, ev: EventContext) -> list[Step]:
    """Each node revoked after a lifetime drawn from the model, and replaced after a drawn delay."""
    v = REVOCATION.validate(value, ev.here)
    nodes = [ev.node(n, "nodes") for n in v["nodes"]]
    if len(set(nodes)) != len(nodes):
        raise ConfigError(f"{ev.here.field('nodes')}: a node is listed twice")
    lifetime = check_lifetime(v["lifetime"], ev.here.at("lifetime"), len(nodes))
    replace = check_delay(v["replace_after_s"], ev.here.at("replace_after_s")) if v["replace_after_s"] else None
    notice = v["notice_s"]
    steps = []
    for i, node in enumerate(nodes):
        life = draw_lifetime_s(lifetime, ev.rng, i, ev.time_scale)
        if life > MAX_SECONDS:  # outlives any run: never revoked
            ev.notes.append(f"events[{ev.index}]: {node} drew a lifetime of {life:.0f} s, past one day: not revoked "
                            f"(time_scale {ev.time_scale:g} multiplies lifetimes in minutes)")
            continue
        steps.append(ev.step(life, "revoke", node, f"SIGTERM, SIGKILL after {notice:g}s (lifetime {life:.3f}s)",
                             {"node": node, "notice_s": notice}))
        if replace is not None:
            delay = draw_delay_s(replace, ev.rng)
            steps.append(ev.step(life + notice + delay, "replace", node, f"after {delay:.3f}s",
                                 {"node": node, "revoked_at_s": ev.at_s + life}))
    return steps


def _background(value: Any, ev: EventContext) -> list[Step]:
    v = BACKGROUND.validate(value, ev.here)
    src, dst = ev.node(v["src"], "src"), ev.node(v["dst"], "dst")
    if src == dst:
        raise ConfigError(f"{ev.here}: a flow needs two different nodes")
    if (v["on_s"] is None) != (v["off_s"] is None):
        raise ConfigError(f"{ev.here}: on_s and off_s go together (ON/OFF), or neither (constant)")
    rate = _parsed(parse_rate_bps, v["rate"], ev.here, "rate")
    pattern = f"on {v['on_s']:g}s / off {v['off_s']:g}s" if v["on_s"] else "constant"
    return [ev.step(0, "background", f"{src}->{dst}", f"{human_rate(rate)} {v['protocol']} {pattern} for {v['for']:g}s",
                    {"src": src, "dst": dst, "rate_bps": rate, "on_s": v["on_s"], "off_s": v["off_s"],
                     "duration_s": v["for"], "protocol": v["protocol"], "key": ev.key})]


def _trace(value: Any, ev: EventContext) -> list[Step]:
    """One step that starts replaying the trace on the link (both ways: on both)."""
    v = TRACE.validate(value, ev.here)
    src, dst = ev.node(v["src"], "src"), ev.node(v["dst"], "dst")
    pairs = ev.pairs(src, dst, v["both_ways"])
    if ev.trace_files is None:
        raise ConfigError(f"{ev.here.field('file')}: a trace needs a scenario file to be read beside")
    replay = ev.trace_files.replay({k: v[k] for k in TRACE_SCHEMA.fields}, ev.here, rate_only="a scenario trace event")
    return [ev.step(0, "trace", _arrow(src, dst, v["both_ways"]), f"replays {replay.describe()}",
                    {"pairs": pairs, "replay": replay})]


def _availability(value: Any, ev: EventContext) -> list[Step]:
    """Each node's leave and return steps from an availability CSV (``controller.model.availability``)."""
    from controller.model import availability
    from controller.model.traces import trace_path

    v = AVAILABILITY.validate(value, ev.here)
    if ev.trace_files is None:
        raise ConfigError(f"{ev.here.field('file')}: an availability file needs a scenario file to be read beside")
    path = trace_path(v["file"], ev.trace_files.base_dir, ev.here)
    traced = availability.by_name(availability.read_csv(path))
    if v["clients"] == "pick":
        nodes = [ev.node(n, "nodes") for n in v["nodes"]] if v["nodes"] is not None else list(ev.topology.nodes)
        plays = availability.pick_clients(list(traced), nodes, ev.rng, f"{ev.here}, {v['file']}")
    else:
        if v["nodes"] is not None:
            raise ConfigError(f"{ev.here.field('nodes')}: only with \"clients\": \"pick\"")
        for name, intervals in traced.items():
            ev.node(name, "node", Place(path).at(f"line {intervals[0].line}"))
        plays = {name: name for name in traced}
    steps = []
    leave, back = (("pause", "frozen"), ("resume", "thawed")) if v["mode"] == "pause" else \
        (("crash", "SIGKILL"), ("replace", "started again"))
    for node, client in plays.items():
        left_at = 0.0
        for t, what in availability.leave_return_s(traced[client], v["time_scale"]):
            who = f" (client {client})" if client != node else ""
            if what == "leave":
                left_at = t
                steps.append(ev.step(t, leave[0], node, f"{leave[1]}: unavailable{who}", {"node": node}))
            else:
                params = {"node": node} if v["mode"] == "pause" else {"node": node, "revoked_at_s": ev.at_s + left_at}
                steps.append(ev.step(t, back[0], node, f"{back[1]}: available{who}", params))
    return steps


def _access(value: Any, ev: EventContext) -> list[Step]:
    v = ACCESS.validate(value, ev.here)
    node = ev.node(v["node"], "node")
    if v["uplink"] is None and v["downlink"] is None:
        raise ConfigError(f"{ev.here}: needs an uplink, a downlink or both")
    parts = {k: _parsed(parse_rate_bps, v[k], ev.here, k) for k in ("uplink", "downlink") if v[k] is not None}
    return [ev.step(0, "access", node, ", ".join(f"{k} {human_rate(r)}" for k, r in parts.items()),
                    {"node": node, **parts})]


class EventRule(NamedTuple):
    """How one kind of event becomes steps."""

    parse: Callable[[Any, EventContext], list[Step]]  # the kind's value -> its steps
    undoable: bool = False  # ``for`` may undo it


EVENTS: dict[EventKind, EventRule] = {  # every kind of scenario.json's events, in KINDS' order
    "link": EventRule(_link, undoable=True), "link_down": EventRule(_link_down, undoable=True),
    "partition": EventRule(_partition, undoable=True), "loss": EventRule(_loss, undoable=True),
    "crash": EventRule(_process), "pause": EventRule(_process, undoable=True), "resume": EventRule(_process),
    "cpu": EventRule(_cpu, undoable=True), "memory": EventRule(_memory, undoable=True),
    "revocation": EventRule(_revocation), "background": EventRule(_background), "trace": EventRule(_trace),
    "access": EventRule(_access), "availability": EventRule(_availability)}
UNDOABLE = tuple(kind for kind, rule in EVENTS.items() if rule.undoable)


def _event_steps(event: Any, index: int, place: Place, topology: Topology, rng: random.Random, time_scale: float,
                 trace_files: Optional[TraceFiles], notes: list[str]) -> list[Step]:
    """Event ``index``'s steps: its trigger and ``for`` checked here, its kind by ``EVENTS``."""
    if not isinstance(event, dict):
        raise ConfigError(f"{place}: expected an event object, got {describe(event)}")
    refuse_unknown(event, (*TRIGGERS, *KINDS, "for"), place)
    triggers = [k for k in TRIGGERS if k in event]
    kinds = [k for k in KINDS if k in event]
    if len(triggers) != 1:
        raise ConfigError(f"{place}: needs exactly one trigger, 'at' (seconds since /start) or 'at_round', "
                          f"got {len(triggers)}")
    if len(kinds) != 1:
        raise ConfigError(f"{place}: needs exactly one event kind ({', '.join(KINDS)}), got "
                          f"{', '.join(kinds) or 'none'}")
    kind = kinds[0]
    after_round = None
    at_s = 0.0
    if "at" in event:
        at_s = SECONDS.check(event["at"], place, "at", ConfigError)
    else:
        r = AT_ROUND.validate(event["at_round"], place.at("at_round"))
        after_round = (_node(topology, r["node"], place.at("at_round"), "node"), r["round"])
    duration = None
    if "for" in event:
        if not EVENTS[kind].undoable:
            raise ConfigError(f"{place.field('for')}: a {kind} event cannot be undone; 'for' is for "
                              f"{', '.join(UNDOABLE)}")
        duration = POSITIVE_SECONDS.check(event["for"], place, "for", ConfigError)
    context = EventContext(index, place, kind, at_s, after_round, duration, topology, rng, time_scale, trace_files, notes)
    return EVENTS[kind].parse(event[kind], context)
