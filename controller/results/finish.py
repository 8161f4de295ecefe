"""Writing the derived files of a run once its nodes have settled and their events are in.

``write_results`` writes, in this order, each step on its own (a failure is one of the run's
``problems``, and the rest goes on): ``confs.json``, ``lives.json``, ``timeline.json``,
``membership.csv``, the final models' evaluation, metrics and plots (``tables.build``),
``summary.json``, the analysis (``analysis/``), ``summary.json`` again with the analysis.
``write_record`` ends ``run.json``. The timeline is the run's own (``controller.run.timeline``)
with the nodes' adaptation events added (``controller.results.adaptation``: they arrive with the
nodes' events, at the end).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from controller.results import adaptation, evaluate, tables
from controller.results.time_to_accuracy import targets_of
from controller.results.run_dir import (ANALYSIS_DIR, CONFS_JSON, LIVES_JSON, MEMBERSHIP_CSV, RUN, RUN_JSON,
                                        SUMMARY_JSON, TIMELINE_JSON, Problems, RunDir, attempt, csv_bytes,
                                        read_run_events)

log = logging.getLogger("edgetb.controller")


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

    def step(what: str, fn: Callable[[], Any], default: Any = None) -> Any:
        return attempt(problems, RUN, what, fn, default)

    events = read_run_events(run_dir, problems)  # (read once: the timeline, membership.csv and the tables)
    step(CONFS_JSON, lambda: out.write_json(CONFS_JSON, {n: {"structure": c} for n, c in run.structure.items()}))
    step(LIVES_JSON, lambda: out.write_json(LIVES_JSON, run.lives))
    if run.timeline is not None:
        step(TIMELINE_JSON, lambda: out.write_json(TIMELINE_JSON,
                                                   {"version": 1, "entries": full_timeline(run, events)}))
    step(MEMBERSHIP_CSV, lambda: out.write_bytes(MEMBERSHIP_CSV, csv_bytes(
        tables.MEMBERSHIP_COLUMNS, tables.membership_rows(events, run.membership))))
    final = step("models", lambda: evaluate.final_models(
        run.workdir, run_dir, run.run_id, run.structure, run.dataset_confs, write=out.write_bytes,
        uids=run.uids), {})
    built = step("metrics and plots", lambda: tables.build(
        run_dir, run.t_start or time.time(), run.algorithm, run.endings, final, write=out.write_bytes,
        problems=problems, events=events, targets=targets_of(run.structure)),
        {"algorithm": run.algorithm, "nodes": [], "plots": [], "models": []})
    summary = {"run_id": run.run_id, "run_dir": run_dir, "ended": run.ended, "endings": run.endings, **built}
    if run.captured:
        summary["captures"] = run.captured
    summary["problems"] = problems
    step(SUMMARY_JSON, lambda: out.write_json(SUMMARY_JSON, summary))
    summary["analysis"] = analyze(out, run_dir, run.run_id, progress)
    step(SUMMARY_JSON, lambda: out.write_json(SUMMARY_JSON, summary))
    return summary


def full_timeline(run: RunResults, events: Optional[dict[str, list[dict[str, Any]]]] = None) -> list[dict[str, Any]]:
    """The run's timeline with the nodes' policy decisions and strategy changes added
    (``events``: the nodes', when read already)."""
    timeline = run.timeline or []
    if run.t_start is None:  # never started: no node acted
        return timeline
    events = read_run_events(run.run_dir, {}) if events is None else events
    adapted = adaptation.adaptation_events(events, run.t_start)
    return adaptation.with_entries(timeline, map(adaptation.timeline_entry, adapted)) if adapted else timeline


def analyze(out: RunDir, run_dir: str, run_id: str, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """The run's analysis (``controller.results.analysis``) into ``analysis/``; a failure is recorded."""
    try:
        from controller.results.analysis import analyze as run_analysis

        done = run_analysis(run_dir, progress=progress, write=out.write_bytes)
        return {"dir": os.path.join(run_dir, ANALYSIS_DIR), "seconds": done["seconds"],
                "missing": done["missing"], "fidelity_ok": done["fidelity"]["ok"]}
    except Exception as e:  # noqa: BLE001 - the run's other files stand without it
        log.exception("analysis of %s failed", run_id)
        return {"error": f"{type(e).__name__}: {e}"}


def write_record(out: RunDir, record: dict[str, Any], ended: str, detail: str, endings: dict[str, str],
                 problems: Problems) -> None:
    """``run.json`` completed with how the run ended, each node's ending and the problems."""
    record.update(ended=ended, ended_at=time.time(), detail=detail, nodes=endings)
    if problems:
        record["problems"] = problems
    attempt(problems, RUN, RUN_JSON, lambda: out.write_json(RUN_JSON, record))
