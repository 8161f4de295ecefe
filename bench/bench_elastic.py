"""Elastic scaling against a fixed-N sweep: where does adding FL trainers stop paying?

Run as root: ``.venv/bin/python bench/bench_elastic.py [--rounds 6] [--repeats 3]``.
Prints Markdown tables on stdout (progress on stderr).

One aggregator and 6 trainers (0.5 core each, 200 digits samples each) on netns nodes; each
trainer's link to the aggregator is 600 kbit/s and the aggregator's access downlink, shared by
every upload, 2100 kbit/s: 3.5 trainers' worth (``tests/e2e/elastic/experiment.py``). The
sweep runs the experiment with N = 1..6 ordinary trainers and no policy, ``--rounds`` rounds
each: T(N) is the median throughput (samples of a round's updates over the round's seconds) of
all rounds but the first, and the gain T(N)/T(N-1) - 1 is compared with alpha/N (alpha = 1/3,
KungFu's rule); the bound is what the links allow (N uploads at the trainer's rate, at most the
downlink's). Then ``--repeats`` runs with every trainer standby and the ``elastic_scaling``
policy (window 2 rounds): the N it stopped at, the changes it made, and the resize latency the
aggregator recorded (decision -> start of the first round with the new members; the goal for
netns nodes is < 3 s), beside the time until that round closed with the new members' updates.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_netns import log, table  # noqa: E402
from controller.model.units import parse_rate_bps  # noqa: E402
from tests.e2e.elastic import experiment as ex  # noqa: E402
from tests.e2e.harness import Run  # noqa: E402

RESIZE_GOAL_S = 3.0


def one_run(scratch: Path, n: Optional[int], rounds: int) -> ex.Result:
    """The experiment, elastic (``n`` None) or with ``n`` fixed trainers, in a fresh directory."""
    tmp = Path(tempfile.mkdtemp(dir=scratch))
    tmp.chmod(0o755)  # node processes run as their own uids and read it
    r = ex.start(functools.partial(Run, tmp), n, rounds=rounds)
    try:
        return ex.finish(r, timeout_s=600)
    finally:
        r.close()


def sweep(scratch: Path, rounds: int) -> tuple[list[list[Any]], dict[int, float]]:
    """The fixed-N runs: a table row and T(N) for each N."""
    rows, t_by_n = [], {}
    uplink_bps, downlink_bps = parse_rate_bps(ex.UPLINK), parse_rate_bps(ex.DOWNLINK)
    for n in range(1, len(ex.TRAINERS) + 1):
        log(f"fixed N = {n}, {rounds} rounds")
        result = one_run(scratch, n, rounds)
        t_by_n[n] = result.throughput_sps()
        round_s = statistics.median(e["t_end"] - e["t_start"] for e in result.rounds[1:])
        bits = 8 * max(max(e["recv_from"].values()) for e in result.rounds)
        bound = ex.SAMPLES_PER_TRAINER * min(n * uplink_bps, downlink_bps) / bits
        gain = ex.gains(t_by_n).get(n)
        rows.append([n, f"{round_s:.2f}", f"{t_by_n[n]:.0f}", f"{bound:.0f}", f"{t_by_n[n] / bound:.2f}",
                     "-" if gain is None else f"{gain:+.1%}", "-" if n == 1 else f"{ex.ALPHA / n:.1%}",
                     "-" if gain is None else ("yes" if gain >= ex.ALPHA / n else "no")])
    return rows, t_by_n


def elastic(scratch: Path, repeat: int) -> tuple[list[list[Any]], int, list[float]]:
    """One elastic run: a row per change, the N it stopped at, its resize latencies."""
    log(f"elastic run {repeat}")
    result = one_run(scratch, None, ex.elastic_rounds())
    rows, latencies_s = [], []
    for change in result.changes:
        at = float(change["t"])
        first = next(e for e in result.rounds if e["t_start"] >= at)
        latency_s = float(first.get("resize_latency_s", float("nan")))
        latencies_s.append(latency_s)
        detail = change["detail"]
        what = "+" + ",".join(detail["added"]) if detail["added"] else "-" + ",".join(detail["removed"])
        rows.append([repeat, first["round"], what, len(detail["members"]), detail["reason"],
                     f"{latency_s * 1e3:.2f}", f"{first['t_end'] - at:.2f}"])
    return rows, result.final_size(), latencies_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each fixed-N run (default 6)")
    parser.add_argument("--repeats", type=int, default=3, help="elastic runs (default 3)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench: run as root")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edgetb-elastic-") as scratch:
        os.chmod(scratch, 0o755)
        sweep_rows, t_by_n = sweep(Path(scratch), args.rounds)
        change_rows, stops, latencies_s = [], [], []
        for i in range(1, args.repeats + 1):
            rows, stop, lat = elastic(Path(scratch), i)
            change_rows += rows
            stops.append(stop)
            latencies_s += lat
    last = ex.last_paying(t_by_n)
    log(f"done in {time.monotonic() - started:.0f} s")
    print(f"Fixed-N sweep ({args.rounds} rounds each, T(N) the median of rounds 2..{args.rounds}; "
          f"trainer uplink {ex.UPLINK}, aggregator downlink {ex.DOWNLINK}, {ex.SAMPLES_PER_TRAINER} samples "
          f"a trainer):\n")
    print(table(["N", "round s", "T(N) samples/s", "link bound", "T / bound", "gain over N-1", "alpha/N", "pays"],
                sweep_rows))
    print(f"\nElastic scaling (window {ex.WINDOW_ROUNDS} rounds, alpha {ex.ALPHA:.3f}), {args.repeats} runs: "
          f"changes, with the resize latency the aggregator recorded and the time until the round with the "
          f"new members closed:\n")
    print(table(["run", "first round", "change", "N after", "reason", "resize latency ms", "to round closed s"],
                change_rows))
    within = all(abs(s - last) <= 1 for s in stops)
    print(f"\n| sweep's last N with gain >= alpha/N | policy stopped at | within +-1 | resize latency median / max ms "
          f"| goal < {RESIZE_GOAL_S:g} s |\n|---|---|---|---|---|\n"
          f"| {last} | {', '.join(map(str, stops))} | {'yes' if within else 'NO'} | "
          f"{statistics.median(latencies_s) * 1e3:.2f} / {max(latencies_s) * 1e3:.2f} | "
          f"{'met' if max(latencies_s) < RESIZE_GOAL_S else 'NOT met'} |")
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
