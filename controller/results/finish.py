"""Writing the derived files of a run once its nodes have settled and their events are in.

``write_results`` writes, in this order, each step on its own (a failure is one of the run's
``problems``, and the rest goes on): ``confs.json``, ``lives.json``, ``timeline.json``,
``membership.csv``, ``traffic.csv``; then the analysis (``analysis/``) starts in a process of its
own (it needs no final model: at 1,000 nodes it takes as long as the rest together, on the
other core), while metrics and plots (``tables.write_tables``) and the final models' evaluation
are written here; ``summary.json``; ``summary.json`` again once the analysis is in.
``write_record`` ends ``run.json``. The timeline is the run's own (``controller.run.timeline``)
with the nodes' adaptation events added (``controller.results.adaptation``: they arrive with the
nodes' events, at the end).
"""
from __future__ import annotations

import functools
import json
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from controller.results import adaptation, evaluate, tables
from controller.results.time_to_accuracy import targets_of
from controller.results.run_dir import (ANALYSIS_DIR, CONFS_JSON, LIVES_JSON, MEMBERSHIP_CSV, RUN, RUN_JSON,
                                        SUMMARY_JSON, TIMELINE_JSON, Problems, RunDir, attempt, csv_bytes,
                                        read_run_events)

log = logging.getLogger("edgetb.controller")
CODE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROGRESS_PREFIX = "edgetb: "  # how the command line says its progress (on stderr)


@dataclass
class RunResults:
    """What a run's results are written from."""

    out: RunDir  # the run folder
    run_dir: str  # its path, as the run names it
    workdir: str  # the experiment directory
    run_id: str
    algorithm: str
    structure: dict[str, dict[str, Any]]  # each node's structure conf, as generated
    ended: str  # how the run ended (run_dir.ENDINGS)
    endings: dict[str, str]  # each node's ending
    t_start: Optional[float] = None  # when the roles started (time.time())
    dataset_confs: dict[str, Any] = field(default_factory=dict)  # each node's dataset conf ({} when none)
    uids: dict[str, int] = field(default_factory=dict)  # each node's uid on this machine, when known
    lives: dict[str, Any] = field(default_factory=dict)  # Membership.lives()
    timeline: Optional[list[dict[str, Any]]] = None  # the run's timeline entries (None: not written)
    membership: list[dict[str, Any]] = field(default_factory=list)  # the controller's membership rows
    captured: dict[str, Any] = field(default_factory=dict)  # each capture's account


def write_results(run: RunResults, problems: Problems,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Every derived file of ``run``; the run's summary (as ``summary.json`` has it)."""
    out, run_dir = run.out, run.run_dir

    step = functools.partial(attempt, problems, RUN)  # step(what, fn, default): a failure is a problem

    events = read_run_events(run_dir, problems)  # (read once: the timeline, membership.csv and the tables)
    step(CONFS_JSON, lambda: out.write_json(CONFS_JSON, {n: {"structure": c} for n, c in run.structure.items()}))
    step(LIVES_JSON, lambda: out.write_json(LIVES_JSON, run.lives))
    if run.timeline is not None:
        step(TIMELINE_JSON, lambda: out.write_json(TIMELINE_JSON,
                                                   {"version": 1, "entries": full_timeline(run, events)}))
    step(MEMBERSHIP_CSV, lambda: out.write_bytes(MEMBERSHIP_CSV, csv_bytes(
        tables.MEMBERSHIP_COLUMNS, tables.membership_rows(events, run.membership))))
    tables.write_traffic(out.write_bytes, problems, events)  # (the analysis' input)
    analysis = step("analysis", lambda: Analysis(run_dir, progress))
    try:
        return _write_rest(run, problems, step, events, analysis)
    finally:
        if analysis is not None:
            analysis.stop()


def _write_rest(run: RunResults, problems: Problems, step: Callable[..., Any],
                events: dict[str, list[dict[str, Any]]], analysis: Optional["Analysis"]) -> dict[str, Any]:
    """``write_results``' files beside the analysis (``step``: its way to attempt one)."""
    out, run_dir = run.out, run.run_dir
    built = step("metrics and plots", lambda: tables.write_tables(
        run_dir, run.t_start or time.time(), run.algorithm, out.write_bytes, problems, events,
        targets_of(run.structure), traffic=False), {"algorithm": run.algorithm, "metrics": None, "traffic": None,
                                                    "plots": [], "plot_mode": None})
    final = step("models", lambda: evaluate.final_models(
        run.workdir, run_dir, run.run_id, run.structure, run.dataset_confs, write=out.write_bytes,
        uids=run.uids), {})
    built = step("the nodes' summary", lambda: tables.summarize(built, events, run.endings, final, problems),
                 {"algorithm": run.algorithm, "nodes": [], "plots": [], "models": []})
    summary = {"run_id": run.run_id, "run_dir": run_dir, "ended": run.ended, "endings": run.endings, **built}
    if run.captured:
        summary["captures"] = run.captured
    summary["problems"] = problems
    step(SUMMARY_JSON, lambda: out.write_json(SUMMARY_JSON, summary))
    summary["analysis"] = analysis.result() if analysis is not None else {"error": "it could not be started"}
    step(SUMMARY_JSON, lambda: out.write_json(SUMMARY_JSON, summary))
    return summary


class Analysis:
    """The run's analysis (``edgetb analyze RUN_DIR --json``) in a process of its own, begun at
    once; its progress lines are relayed to ``progress``. ``result`` waits for it: its summary
    in brief, or ``{"error": ...}``."""

    def __init__(self, run_dir: str, progress: Callable[[str], None] = print) -> None:
        self.run_dir = run_dir
        self.progress = progress
        self.proc = subprocess.Popen([sys.executable, "-m", "controller", "analyze", "--json", "--",
                                      os.path.abspath(run_dir)],
                                     cwd=CODE_ROOT, env={**os.environ, "PYTHONPATH": CODE_ROOT},
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.said: list[str] = []
        self._relay = threading.Thread(target=self._read_progress, name="edgetb-analysis", daemon=True)
        self._relay.start()

    def stop(self) -> None:
        """End the process if it still runs (the results were interrupted)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def _read_progress(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            self.said.append(line)
            if line.startswith(PROGRESS_PREFIX):
                self.progress(line[len(PROGRESS_PREFIX):])

    def result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()  # (not communicate(): stderr is the relay's alone, or the two
        self.proc.stdout.close()       # readers race for it, and a read waits while stdout fills)
        self.proc.wait()
        self._relay.join(timeout=5)
        try:
            done = json.loads(out) if self.proc.returncode == 0 else None
        except ValueError:
            done = None
        if not isinstance(done, dict):
            why = next((l for l in reversed(self.said) if l.strip()), f"exit code {self.proc.returncode}")
            log.error("analysis of %s failed: %s", self.run_dir, "\n".join(self.said[-20:]))
            return {"error": why[len(PROGRESS_PREFIX):] if why.startswith(PROGRESS_PREFIX) else why}
        return {"dir": os.path.join(self.run_dir, ANALYSIS_DIR), "seconds": done.get("seconds"),
                "missing": done.get("missing"), "fidelity_ok": (done.get("fidelity") or {}).get("ok")}


def full_timeline(run: RunResults, events: Optional[dict[str, list[dict[str, Any]]]] = None) -> list[dict[str, Any]]:
    """The run's timeline with the nodes' policy decisions and strategy changes added
    (``events``: the nodes', when read already)."""
    timeline = run.timeline or []
    if run.t_start is None:  # never started: no node acted
        return timeline
    events = read_run_events(run.run_dir, {}) if events is None else events
    adapted = adaptation.adaptation_events(events, run.t_start)
    return adaptation.with_entries(timeline, map(adaptation.timeline_entry, adapted)) if adapted else timeline


def write_record(out: RunDir, record: dict[str, Any], ended: str, detail: str, endings: dict[str, str],
                 problems: Problems) -> None:
    """``run.json`` completed with how the run ended, each node's ending and the problems."""
    record.update(ended=ended, ended_at=time.time(), detail=detail, nodes=endings)
    if problems:
        record["problems"] = problems
    attempt(problems, RUN, RUN_JSON, lambda: out.write_json(RUN_JSON, record))
