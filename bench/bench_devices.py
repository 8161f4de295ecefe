"""Device classes, modelled energy and availability traces against issue 49's targets.

Run as root: ``.venv/bin/python bench/bench_devices.py [--rounds 5] [--factors 2 4 8] [--skip-slowdown]``.
Prints Markdown tables on stdout (progress on stderr).

- **Slowdown**: a node's round (one epoch of ``edgetb_fashion_cnn`` in numpy over 100 samples of
  28x28x1, batches of 32, one thread) timed unconstrained in a child process, median of
  ``--rounds`` of its CPU time (its wall time too, which other load on the host inflates); then,
  wall time, in a cgroup with the CPU quota a one-core device class of slowdown f gets
  (1/f of a core, through ``worker.confinement.cgroups``, as nodes get theirs), median of as many
  rounds. Target: within 15 % of the unconstrained time x f, for f = 2, 4 and 8.
- **Energy**: the model's cost is paid once, from the stored telemetry, when the run finishes
  (the samplers do nothing more): the time to compute every round's energy of 147 nodes from
  10 Hz telemetry of a 600 s run, as a share of one core over those 600 s. Target: 0.5 %.
- **Availability**: 1,000 trace clients (each with two intervals) onto 100 nodes, the seeded
  pick included: the time to read, check and resolve the scenario into steps. Applying the steps
  is the scenario runner's, as for every scenario event (``bench/bench_scenario.py``).
"""
from __future__ import annotations

import os

for _name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_name, "1")  # before numpy: one thread, as a node

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def rounds_child(rounds: int) -> None:
    """In the child: warm up, then print each round's wall seconds as a JSON list."""
    from dml_app.models.make import make_model

    data = np.random.default_rng(0)
    x = data.random((100, 28, 28, 1), dtype=np.float32)
    y = data.integers(0, 10, 100)
    net = make_model({"kind": "numpy", "name": "edgetb_fashion_cnn", "learning_rate": 0.01, "seed": 0},
                     (28, 28, 1), 10)
    net.train(x, y, 1, 32)
    times = []
    for _ in range(rounds):
        t0, c0 = time.perf_counter(), time.process_time()
        net.train(x, y, 1, 32)
        times.append((time.perf_counter() - t0, time.process_time() - c0))
    print(json.dumps(times))


def timed_rounds(rounds: int, procs_files: list[str]) -> list[list[float]]:
    """A child process's rounds, [wall s, CPU s] each; it joins the cgroups of ``procs_files`` before it starts."""
    def join() -> None:
        for path in procs_files:
            with open(path, "w") as f:
                f.write("0")

    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child-rounds", str(rounds)],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         preexec_fn=join if procs_files else None)
    return json.loads(out.stdout.strip().splitlines()[-1])


def slowdown(rounds: int, factors: list[float]) -> list[dict]:
    from worker.confinement.cgroups import Cgroups

    free = timed_rounds(rounds, [])
    wall = statistics.median(w for w, _ in free)
    base = statistics.median(c for _, c in free)  # CPU time: what the round needs, whatever else runs
    log(f"unconstrained round: {wall * 1000:.0f} ms wall, {base * 1000:.0f} ms CPU")
    cg = Cgroups(f"edgetb-bench{os.getpid()}")
    cg.require()
    rows = []
    try:
        for f in factors:
            name = f"f{f:g}"
            cg.create(name, 1.0 / f, None)
            got = statistics.median(w for w, _ in timed_rounds(rounds, cg.procs_files(name)))
            want = base * f
            rows.append({"factor": f, "quota_cores": round(1.0 / f, 4), "round_ms": round(got * 1000, 1),
                         "target_ms": round(want * 1000, 1), "error_pct": round((got / want - 1) * 100, 1),
                         "met": abs(got / want - 1) <= 0.15})
            log(f"factor {f:g}: {got * 1000:.0f} ms against {want * 1000:.0f} ms")
            cg.remove(name)
    finally:
        cg.remove_all()
    return rows


def energy_cost(nodes: int = 147, span_s: float = 600.0, period_s: float = 0.1, rounds: int = 60) -> dict:
    """Every round's energy of ``nodes`` nodes from synthetic 10 Hz telemetry, timed; each node
    away twice (an availability trace's pauses: the away windows' cost included)."""
    from controller.results import energy

    t = np.arange(0, span_s + period_s / 2, period_s)
    rng = np.random.default_rng(0)
    telemetry = {f"n{i}": (t, np.cumsum(rng.random(len(t)) * 0.05), np.cumsum(rng.integers(0, 10_000, len(t))))
                 for i in range(nodes)}
    away = ((100.0, 160.0), (400.0, 430.0))
    models = {n: energy.PowerModel(2.7, 6.4, 0.5, 1e-8, away) for n in telemetry}
    rows = [{"node": n, "round": r, "time_s": (r + 1) * span_s / rounds} for n in telemetry for r in range(rounds)]
    cpu0 = time.process_time()
    energy.round_energy(rows, telemetry, models)
    energy.node_energy(telemetry, models)
    cpu = time.process_time() - cpu0
    return {"nodes": nodes, "samples_per_node": len(t), "cpu_s": round(cpu, 3),
            "share_of_a_core_pct": round(cpu / span_s * 100, 4), "met": cpu / span_s <= 0.005}


def availability_plan(clients: int = 1000, nodes: int = 100) -> dict:
    from controller.model.scenario import load_scenario
    from controller.model.topology import Topology

    topo = Topology()
    for i in range(nodes):
        topo.add_node(f"n{i}")
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "trace.csv"), "w") as f:
            f.write("node,t_on_s,t_off_s\n")
            for c in range(clients):
                f.write(f"c{c},{c % 50},{c % 50 + 30}\nc{c},{c % 50 + 60},{c % 50 + 90}\n")
        with open(os.path.join(d, "scenario.json"), "w") as f:
            json.dump({"seed": 1, "events": [{"at": 0, "availability": {"file": "trace.csv", "clients": "pick"}}]}, f)
        t0 = time.perf_counter()
        timeline = load_scenario(os.path.join(d, "scenario.json"), topo)
        took = time.perf_counter() - t0
    return {"clients": clients, "nodes": nodes, "steps": len(timeline.steps), "plan_s": round(took, 4),
            "met": took <= 1.0}


def table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--factors", type=float, nargs="+", default=[2.0, 4.0, 8.0])
    parser.add_argument("--skip-slowdown", action="store_true", help="no cgroups: the energy and availability parts")
    parser.add_argument("--child-rounds", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_rounds:
        rounds_child(args.child_rounds)
        return 0
    if not args.skip_slowdown:
        print("## Slowdown\n\n" + table(slowdown(args.rounds, args.factors)) + "\n")
    print("## Energy\n\n" + table([energy_cost()]) + "\n")
    print("## Availability\n\n" + table([availability_plan()]) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
