"""Benchmark of the adaptive all-reduce strategy under interference, beside KungFu's figures.

Run as root: ``.venv/bin/python bench/bench_adaptation.py [--rounds 30] [--modes none kungfu robust]
[--plot docs/img/adaptation.png]``. Prints a Markdown table on stdout (progress on stderr).

The experiment of ``examples/adaptation/`` (``tests/e2e/adaptation.py``): 8 netns nodes, every
pair linked at 10 Mbit/s, a ring all-reduce of a numpy MLP (0.15 M parameters, 0.6 MB a copy) on
digits averaged over ``star:n1``; once n1 reports round 10, two TCP flows of 4 Mbit/s load each of
n1's links to n2..n7. Three runs: no policy, ``adaptive_strategy`` in ``kungfu`` mode (alternative
``star:n8``) and in ``robust`` mode (it picks the strategy from the measured rates).

Goodput is ``comm_goodput_bps`` (the model's bytes over the time of a node's all-reduce), the
median over the 8 members each round. Columns: the median before the flows (rounds 2..10), at the
drop (the first round below 0.8 x before), over rounds drop + 3 .. drop + 6 and its share of
before (recovery); the round the new strategy first ran; KungFu's two figures, against the mean
before as KungFu reports them: the lowest round between the drop and the switch, and the fourth
round under the new strategy (KungFu: 67 % and 94 %).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_netns import log, table  # noqa: E402
from tests.e2e.adaptation import Outcome, analyse, make_run  # noqa: E402
from tests.e2e.harness import Run  # noqa: E402
from tests.e2e.test_algorithms import run_to_end  # noqa: E402

MODES: dict[str, Optional[list[dict[str, Any]]]] = {
    "none": None,
    "kungfu": [{"kind": "adaptive_strategy", "mode": "kungfu", "alternative": "star:n8"}],
    "robust": [{"kind": "adaptive_strategy", "mode": "robust"}],
}
KUNGFU_DROP_PCT = 67.0  # KungFu (OSDI'20) artifact: throughput at the interference, % of the mean before
KUNGFU_BACK_PCT = 94.0  # ... four iterations after the policy switched strategy
AFTER_SWITCH_ROUND = 4  # the fourth round under the new strategy


def run_mode(mode: str, rounds: int, hidden: Optional[int], timeout_s: float) -> Outcome:
    tmp = Path(tempfile.mkdtemp(prefix=f"edgetb-adaptation-{mode}-"))
    os.chmod(tmp, 0o755)  # node processes run as their own uids and read it
    r: Optional[Run] = None

    def make(**kw: Any) -> Run:
        nonlocal r
        r = Run(tmp, **kw)
        return r

    try:
        started = time.monotonic()
        make_run(make, MODES[mode], rounds, interference=True, hidden=hidden)
        summary, _ = run_to_end(r, timeout_s=timeout_s)
        unfinished = [n["node"] for n in summary["nodes"] if n["ended"] != "done" or n["rounds"] != rounds]
        if unfinished:
            log(f"  {mode}: not every node ran {rounds} rounds: {', '.join(unfinished)}")
        outcome = analyse(Path(summary["run_dir"]))
        log(f"  {mode}: {time.monotonic() - started:.0f} s; goodput by round (Mbit/s): "
            + json.dumps({k: round(v / 1e6, 2) for k, v in outcome.goodput_bps.items()}))
        return outcome
    finally:
        if r is not None:
            r.close()
        shutil.rmtree(tmp, ignore_errors=True)


def pct(part: Optional[float], whole: Optional[float]) -> str:
    return "-" if not part or not whole else f"{100 * part / whole:.0f} %"


def mbit(bps: Optional[float]) -> str:
    return "-" if bps is None else f"{bps / 1e6:.2f}"


def kungfu_figures(o: Outcome) -> tuple[Optional[float], Optional[float]]:
    """(the lowest round from the drop to the switch, the fourth round under the new strategy)."""
    if o.drop_round is None:
        return None, None
    end = o.switch_round or o.rounds + 1
    low = min((o.goodput_bps[r] for r in range(o.drop_round, end) if r in o.goodput_bps), default=None)
    back = o.goodput_bps.get(o.switch_round + AFTER_SWITCH_ROUND - 1) if o.switch_round else None
    return low, back


def row(mode: str, o: Outcome) -> list[Any]:
    low, back = kungfu_figures(o)
    switched = f"{o.switch_round} ({o.strategy[o.switch_round]})" if o.switch_round else "-"
    return [mode, o.rounds, mbit(o.before_bps), mbit(o.at_drop_bps), mbit(o.after_bps), pct(o.after_bps, o.before_bps),
            o.drop_round or "-", switched, pct(low, o.before_mean_bps), pct(back, o.before_mean_bps)]


def plot(outcomes: dict[str, Outcome], path: str, trigger_round: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8), dpi=120)
    styles = {"none": ("tab:gray", "no policy"), "kungfu": ("tab:orange", "kungfu mode"),
              "robust": ("tab:blue", "robust mode")}
    for mode, o in outcomes.items():
        color, label = styles.get(mode, (None, mode))
        rounds = sorted(o.goodput_bps)
        if o.switch_round:
            label += f", to {o.strategy[o.switch_round]} in round {o.switch_round}"
        ax.plot(rounds, [o.goodput_bps[r] / 1e6 for r in rounds], marker="o", markersize=3, color=color, label=label)
        if o.switch_round:
            ax.plot([o.switch_round], [o.goodput_bps[o.switch_round] / 1e6], marker="*", markersize=12, color=color)
    ax.axvline(trigger_round + 0.5, color="tab:red", linestyle="--", linewidth=1)
    ax.text(trigger_round + 0.7, 0.15, "2 x 4 Mbit/s of TCP on n1's links to n2..n7", color="tab:red", fontsize=8)
    ax.set_xlabel("round")
    ax.set_ylabel("all-reduce goodput (Mbit/s, median of 8)")
    ax.set_ylim(bottom=0)
    ax.set_title("star:n1 all-reduce under interference, 8 nodes at 10 Mbit/s", fontsize=10)
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0.0, 0.12))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    from tests.e2e.adaptation import ROUNDS, TRIGGER_ROUND

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=max(ROUNDS, 30))
    p.add_argument("--modes", nargs="+", choices=sorted(MODES), default=["none", "kungfu", "robust"])
    p.add_argument("--hidden", type=int, help="the MLP's hidden width (default: the example's, 2048)")
    p.add_argument("--plot", default=os.path.join(ROOT, "docs", "img", "adaptation.png"),
                   help="where to write the goodput plot ('' for none)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("run as root", file=sys.stderr)
        return 2
    outcomes: dict[str, Outcome] = {}
    for mode in args.modes:
        log(f"{mode}: 8 nodes, {args.rounds} rounds, flows from round {TRIGGER_ROUND + 1}")
        outcomes[mode] = run_mode(mode, args.rounds, args.hidden, args.timeout)
    print(f"\nAll-reduce goodput under interference (star:n1, 8 nodes, 10 Mbit/s links, two TCP flows of 4 Mbit/s "
          f"on each of n1's links to n2..n7 from round {TRIGGER_ROUND + 1}); Mbit/s, median of the members\n")
    headers = ["policy", "rounds", "before", "at the drop", "drop +3..+6", "recovery", "drop round", "switch round",
               "lowest before the switch (% of mean)", f"round {AFTER_SWITCH_ROUND} after the switch (% of mean)"]
    rows = [row(mode, o) for mode, o in outcomes.items()]
    rows.append(["KungFu (OSDI'20 artifact)", "-", "-", "-", "-", "-", "-", "-", f"{KUNGFU_DROP_PCT:.0f} %",
                 f"{KUNGFU_BACK_PCT:.0f} %"])
    print(table(headers, rows))
    if args.plot:
        plot(outcomes, args.plot, TRIGGER_ROUND)
        print(f"\nplot: {os.path.relpath(args.plot, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
