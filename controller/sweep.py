"""``edgetb sweep FILE``: an experiment as a series of runs, one after another, each kept.

The sweep file (``controller.model.sweep``) is checked whole before any run starts: every
parameter path, every value against the schema of the file it lands in (each value alone, then
every configuration), the grid not empty. Each run is then the run script of its algorithm
(``gl_run.py --auto`` ...) in the experiment directory, with the files made for it (only those
a parameter or a seed changes, with the trace files they name beside them; the others are the
base files themselves), its output in
``runs/<name>/output.log``, its run folder moved to ``runs/<name>/run/``. Nodes are made anew
for every run (deploy and teardown are a few seconds of each run; reusing them between runs is
not done yet). A sweep runs on this host only (a ``hosts`` field is refused by the model).

``state.json`` records each run as it goes: ``running``, then ``completed`` or ``failed`` (the
run script's exit code and how the run ended), or ``interrupted`` (Ctrl-C, SIGTERM, SIGHUP: the
run in progress is torn down and collected by its own script). Starting the same sweep again
continues: completed and failed runs are kept (``retry_failed`` runs the failed ones again),
the others run. A base file changed since the sweep started is refused (a new ``out`` starts
a new sweep). After every run, and at the end, the sweep's table is rebuilt
(``controller.results.sweep_table``).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from controller.model import sweep as model
from controller.model.sweep import ALGORITHM, PREFIXES, RunPlan, Sweep, load_sweep
from controller.results import sweep_table as table
from controller.results.run_dir import RUN_JSON, RunDir, read_json
from worker.api.errors import ConfigError, TestbedError
from worker.api.schema import Place, read_json as read_user_json

ROLES = ("links", "nodes", "structure", "dataset", "scenario")
STOP_GRACE_S = 300.0  # beyond the run's own timeout, before the sweep stops its run script
Progress = Callable[[str], None]


def _say(message: str) -> None:
    try:
        print(f"[{time.strftime('%H:%M:%S')}] sweep: {message}", flush=True)
    except OSError:
        pass


@dataclass
class Outcome:
    """How a sweep ended: runs completed, failed and left (interrupted or not reached)."""

    sweep_dir: str
    runs: int
    completed: int
    failed: int
    left: int
    summary: dict[str, Any]

    @property
    def exit_code(self) -> int:
        return 130 if self.left else 1 if self.failed else 0


# the files of a run -----------------------------------------------------------------------------
class Files:
    """The base files of a sweep, read once, and the files of each run made from them."""

    def __init__(self, sweep: Sweep) -> None:
        self.sweep = sweep
        self._docs: dict[str, Any] = {}

    def base_paths(self, algorithm: str) -> dict[str, str]:
        """Role -> the base file (absolute) of ``algorithm``'s runs."""
        out = {}
        for role in ROLES:
            rel = self.sweep.file_of(role, algorithm)
            if rel:
                out[role] = model.inside(self.sweep.workdir, rel, f"{self.label}: base, the {role} file")
        return out

    @property
    def label(self) -> str:
        return self.sweep.label

    def doc(self, path: str) -> Any:
        if path not in self._docs:
            self._docs[path] = read_user_json(path, ConfigError)
        return self._docs[path]

    def digest(self) -> str:
        """A digest of every base file the sweep reads, to refuse resuming over changed files."""
        h = hashlib.sha256()
        for algorithm in sorted({self.sweep.algorithm_of(r) for r in self.sweep.runs}):
            for role, path in sorted(self.base_paths(algorithm).items()):
                with open(path, "rb") as f:
                    h.update(f"{algorithm}:{role}:".encode() + hashlib.sha256(f.read()).digest())
        return h.hexdigest()

    def make(self, algorithm: str, values: list[tuple[str, Any, Place]], dest: str) -> dict[str, str]:
        """Role -> file (absolute) of a run with ``values`` (parameter, value, where it was asked):
        the changed files written into ``dest``, the others the base files."""
        paths = self.base_paths(algorithm)
        docs = {role: copy.deepcopy(self.doc(p)) for role, p in paths.items()}
        parsed = self.sweep.paths()
        changed = set()
        for name, value, where in values:
            path = parsed[name]
            if path.file not in docs:
                raise ConfigError(f"{where}: unknown parameter path {name!r}: the {algorithm} runs have no "
                                  f"{path.file} file (name one in base)")
            model.set_path(docs[path.file], path, value, where)
            changed.add(path.file)
        out = RunDir(dest)  # every write beneath it without following a link
        try:
            for role in sorted(changed):
                name = os.path.basename(paths[role])
                out.write_bytes(name, (json.dumps(docs[role], indent=1) + "\n").encode())
                self._copy_traces(docs[role], os.path.dirname(paths[role]), out)
                paths[role] = os.path.join(out.path, name)
        finally:
            out.close()
        return paths

    @staticmethod
    def _copy_traces(doc: Any, source_dir: str, out: RunDir) -> None:
        """The trace files a file names (``"trace": {"file": ...}`` in links, nodes and scenario
        files), beside its copy: a trace is read beside the file that names it."""
        root = os.path.realpath(source_dir)
        for name in sorted(set(trace_files(doc))):
            src = os.path.realpath(os.path.join(root, name))
            if os.path.commonpath([root, src]) == root and os.path.isfile(src):  # else the check refuses it
                with open(src, "rb") as f:
                    chunks = iter(lambda: f.read(1 << 20), b"")
                    out.write_chunks(os.path.relpath(src, root).replace(os.sep, "/"), chunks)


def trace_files(doc: Any) -> Iterator[str]:
    """Every ``file`` of a ``"trace"`` object in ``doc``, at any depth."""
    if isinstance(doc, dict):
        for key, value in doc.items():
            if key == "trace" and isinstance(value, dict) and isinstance(value.get("file"), str):
                yield value["file"]
            yield from trace_files(value)
    elif isinstance(doc, list):
        for value in doc:
            yield from trace_files(value)


def check_files(paths: dict[str, str], algorithm: str) -> None:
    """Every file of a run read and validated as the run script will (nothing is written)."""
    from controller.confs.confs import load_dataset, load_structure
    from controller.model.scenario import load_scenario
    from controller.model.topology import load_links, load_nodes
    from controller.calibration import host_kernel_s

    declared = load_nodes(paths["nodes"], host_kernel_s) if paths.get("nodes") else None
    topology = load_links(paths["links"], declared, nodes_declared=declared is not None)
    load_structure(paths["structure"], topology, algorithm)
    load_dataset(paths["dataset"])
    if paths.get("scenario"):
        load_scenario(paths["scenario"], topology)


def run_values(sweep: Sweep, plan: RunPlan) -> list[tuple[str, Any, Place]]:
    """What ``plan`` writes into its files: (parameter, value, where the sweep file asks it)."""
    label = sweep.label
    out = [(name, value, Place(label, (f"vary[{name!r}]",))) for name, value in plan.params.items()
           if name != ALGORITHM]
    if plan.seed is not None:
        out += [(p.text, plan.seed, Place(label, (f"repeats, set {p.text!r}",))) for p in sweep.seed_paths]
    return out


def check(sweep: Sweep, files: Optional[Files] = None) -> None:
    """Refuse, before any run, a parameter path or value the experiment's files refuse: each
    value alone (the error names the sweep file, the parameter and the value), then every run."""
    files = files or Files(sweep)
    label = sweep.label
    algorithms = sorted({sweep.algorithm_of(r) for r in sweep.runs})
    for algorithm in algorithms:
        files.base_paths(algorithm)  # inside the experiment directory
    with tempfile.TemporaryDirectory(prefix="edgetb-sweep-check-") as tmp:
        for name, values in sweep.params:
            for i, value in enumerate(values):
                where = Place(label, (f"vary[{name!r}] value {i} ({json.dumps(value)})",))
                for algorithm in sorted({sweep.algorithm_of(r) for r in sweep.runs if r.params[name] == value}):
                    one = [] if name == ALGORITHM else [(name, value, where)]
                    _checked(lambda: check_files(files.make(algorithm, one, os.path.join(tmp, "one")), algorithm),
                             f"{where}, {algorithm}", label, (os.path.join(tmp, "one"), sweep.workdir))
        for plan in sweep.runs:
            algorithm = sweep.algorithm_of(plan)
            where = f"{label}: run {plan.index} ({describe(plan)})"
            _checked(lambda: check_files(files.make(algorithm, run_values(sweep, plan),
                                                    os.path.join(tmp, plan.name)), algorithm), where, label,
                     (os.path.join(tmp, plan.name), sweep.workdir))


def _checked(fn: Callable[[], Any], where: str, label: str, dirs: tuple[str, ...] = ()) -> None:
    """``fn()``; its error names ``where`` first (unless it names the sweep file ``label`` already),
    and the files by their names (not the directories ``dirs`` they were checked in)."""
    try:
        fn()
    except TestbedError as e:
        if e.message.startswith(f"{label}:"):
            raise
        message = e.message
        for d in sorted(dirs, key=len, reverse=True):
            message = message.replace(d.rstrip(os.sep) + os.sep, "")
        raise ConfigError(f"{where}: {message}") from None


def describe(plan: RunPlan) -> str:
    """A run's parameters and seed in words."""
    parts = [f"{k}={v if isinstance(v, (str, int, float)) else json.dumps(v)}" for k, v in plan.params.items()]
    if plan.seed is not None:
        parts.append(f"seed {plan.seed}")
    return ", ".join(parts)


# the sweep folder ---------------------------------------------------------------------------------
def plan_doc(sweep: Sweep, digest: str, names: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """plan.json: the sweep's runs; ``names``: a run's folder name by key, where an earlier
    sweep in the folder gave it one (a grown grid renumbers runs, not their folders)."""
    names = names or {}
    return {"version": 1, "sweep_file": sweep.path, "workdir": sweep.workdir, "base": sweep.base,
            "base_digest": digest, "varied": sweep.varied, "values": dict(sweep.params),
            "seeds": sweep.seeds, "runs": [{"index": r.index, "name": names.get(r.key, r.name), "key": r.key, "config": r.config,
                                           "repeat": r.repeat, "seed": r.seed, "params": r.params,
                                           "algorithm": sweep.algorithm_of(r)} for r in sweep.runs]}


def pending(plan: list[RunPlan], state: dict[str, Any], retry_failed: bool = False) -> list[RunPlan]:
    """The runs still to run: neither completed nor (unless ``retry_failed``) failed."""
    keep = {"completed"} if retry_failed else {"completed", "failed"}
    runs = state.get("runs", {})
    return [r for r in plan if runs.get(r.key, {}).get("status") not in keep]


def time_left_s(durations: list[float], remaining: int) -> Optional[float]:
    """The mean of the runs' durations so far times the runs left (None before the first)."""
    return sum(durations) / len(durations) * remaining if durations else None


def _minutes(seconds: Optional[float]) -> str:
    if seconds is None:
        return "time left unknown until a run ends"
    return f"about {seconds / 60:.1f} min left" if seconds >= 60 else f"about {seconds:.0f} s left"


class SweepDir:
    """The sweep folder: its plan, its state (written at every change) and its runs."""

    def __init__(self, path: str) -> None:
        self.out = RunDir(path)
        self.path = self.out.path
        self.state: dict[str, Any] = read_json(os.path.join(self.path, table.STATE_JSON)) or {"version": 1,
                                                                                              "runs": {}}
        self.state.setdefault("runs", {})

    def start(self, sweep: Sweep, digest: str) -> None:
        """Record the plan; an earlier sweep in the folder must have read the same base files."""
        old = read_json(os.path.join(self.path, table.PLAN_JSON))
        if isinstance(old, dict) and old.get("base_digest") not in (None, digest):
            raise ConfigError(f"{sweep.label}: the experiment's files changed since the sweep in "
                              f"{self.path} started; its runs would not compare. Set \"out\" to a new folder to "
                              "start a new sweep, or restore the files")
        with open(sweep.path, "rb") as f:
            self.out.write_bytes(table.SWEEP_FILE, f.read())
        self.out.write_json(table.PLAN_JSON, plan_doc(sweep, digest, {k: e["name"] for k, e in
                                                                      self.state["runs"].items() if e.get("name")}))
        for entry in self.state["runs"].values():  # a sweep stopped hard: its run in progress did not finish
            if entry.get("status") == "running":
                entry.update(status="interrupted", detail="the sweep stopped during the run")
        self.save()

    def record(self, plan: RunPlan, **fields: Any) -> None:
        entry = self.state["runs"].setdefault(plan.key, {})
        entry.update(name=self.name(plan), index=plan.index, **fields)
        self.save()

    def save(self) -> None:
        self.out.write_json(table.STATE_JSON, self.state)

    def name(self, plan: RunPlan) -> str:
        """The run's folder name: the one it was first given in this sweep folder."""
        return self.state["runs"].get(plan.key, {}).get("name") or plan.name

    def folder(self, plan: RunPlan) -> str:
        return os.path.join(self.path, table.RUNS_DIR, self.name(plan))

    def tables(self, plots: bool = True) -> dict[str, Any]:
        return table.build(self.path, self.out.write_bytes, plots=plots)


# one run -------------------------------------------------------------------------------------------
def run_script(algorithm: str) -> str:
    from worker.host import REPO_ROOT

    return os.path.join(REPO_ROOT, f"{PREFIXES[algorithm]}_run.py")


def command(sweep: Sweep, algorithm: str, paths: dict[str, str]) -> list[str]:
    """The run script's argv for one run (a list: no shell, no string built from input)."""
    run = sweep.run
    argv = [sys.executable, run_script(algorithm), "--workdir", sweep.workdir, "--auto", "--quiet-nodes",
            "--id", run["testbed_id"], "--subnet", run["subnet"], "--port", str(run["port"]),
            "--timeout", f"{run['timeout_s']:g}"]
    for role in ROLES:
        if paths.get(role):
            argv += [f"--{role}", os.path.relpath(paths[role], sweep.workdir)]
    return argv


def _log_dir(sweep: Sweep) -> str:
    return os.path.join(sweep.workdir, "dml_file", "log")


def _runs_in(log_dir: str) -> set[str]:
    try:
        return {n for n in os.listdir(log_dir) if os.path.isdir(os.path.join(log_dir, n))}
    except FileNotFoundError:
        return set()


def run_one(sweep: Sweep, files: Files, plan: RunPlan, folder: str) -> dict[str, Any]:
    """Run ``plan`` with its run script; its run folder moved into ``folder``/run. Returns its
    state entry (status, detail, run_id, exit_code, seconds). KeyboardInterrupt: the run script
    got the signal too (or is sent SIGTERM), and is waited for before this returns it."""
    algorithm = sweep.algorithm_of(plan)
    previous = os.path.join(folder, table.RUN_FOLDER)
    if os.path.isdir(previous):  # an interrupted attempt: kept beside, never overwritten
        os.replace(previous, os.path.join(folder, f"interrupted-{time.strftime('%Y%m%d-%H%M%S')}"))
    paths = files.make(algorithm, run_values(sweep, plan), os.path.join(folder, table.INPUTS_DIR))
    argv = command(sweep, algorithm, paths)
    log_dir = _log_dir(sweep)
    before = _runs_in(log_dir)
    started = time.monotonic()
    interrupted: Optional[BaseException] = None
    log_fd = os.open(os.path.join(folder, table.OUTPUT_LOG),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    with os.fdopen(log_fd, "wb") as out:
        out.write(("$ " + " ".join(argv) + "\n").encode())
        out.flush()
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                cwd=sweep.workdir)
        try:
            code = proc.wait(timeout=sweep.run["timeout_s"] + STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)  # it tears its testbed down and collects what there is
            code = _wait_out(proc)
        except KeyboardInterrupt as e:
            interrupted = e
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            code = _wait_out(proc)
    seconds = round(time.monotonic() - started, 3)
    made = sorted(_runs_in(log_dir) - before)
    run_id = made[-1] if made else None
    if run_id is not None:
        os.replace(os.path.join(log_dir, run_id), previous)
    record = read_json(os.path.join(previous, RUN_JSON)) if run_id else None
    ended = record.get("ended") if isinstance(record, dict) else None
    if interrupted is not None:
        entry = {"status": "interrupted", "detail": "the sweep was interrupted during the run"}
    elif code == 0 and run_id is not None:
        entry = {"status": "completed", "detail": ended or ""}
    else:
        why = "no run folder" if run_id is None else f"ended: {ended}" if ended else "no run.json"
        log = f"{table.RUNS_DIR}/{os.path.basename(folder)}/{table.OUTPUT_LOG}"
        entry = {"status": "failed", "detail": f"exit code {code}, {why} (see {log})"}
    entry.update(run_id=run_id, exit_code=code, seconds=seconds, command=argv)
    if interrupted is not None:
        entry["_interrupt"] = interrupted
    return entry


def _wait_out(proc: subprocess.Popen) -> int:
    """The run script's exit code, once it has removed its testbed (it may take a while)."""
    while True:
        try:
            return proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
        except KeyboardInterrupt:  # a second Ctrl-C: the script is still tearing down; wait on
            continue


# the sweep -------------------------------------------------------------------------------------------
def run_sweep(path: str, workdir: Optional[str] = None, retry_failed: bool = False,
              progress: Progress = _say, plots: bool = True) -> Outcome:
    """Run the sweep file ``path`` (see the module docstring); resumes what its folder holds."""
    sweep = load_sweep(path, workdir)
    files = Files(sweep)
    check(sweep, files)
    if os.geteuid() != 0:
        raise ConfigError("run the sweep as root (sudo): its runs' nodes are network namespaces")
    for algorithm in sorted({sweep.algorithm_of(r) for r in sweep.runs}):
        if not os.path.isfile(run_script(algorithm)):
            raise ConfigError(f"{sweep.label}: no run script {run_script(algorithm)} for the {algorithm} runs "
                              "(a sweep runs from the testbed's checkout)")
    folder = SweepDir(sweep.out)
    folder.start(sweep, files.digest())
    todo = pending(sweep.runs, folder.state, retry_failed)
    total = len(sweep.runs)
    kept = total - len(todo)
    progress(f"{total} runs ({len(sweep.runs) // len(sweep.seeds)} configurations x {len(sweep.seeds)} repeats) "
             f"in {folder.path}" + (f"; {kept} kept from before" if kept else ""))
    durations: list[float] = []
    old_handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        for i, plan in enumerate(todo):
            progress(f"run {plan.index} of {total} ({describe(plan)}): started; "
                     f"{_minutes(time_left_s(durations, len(todo) - i))}")
            os.makedirs(folder.folder(plan), exist_ok=True)
            folder.record(plan, status="running", started_at=time.time())
            try:
                entry = run_one(sweep, files, plan, folder.folder(plan))
            except TestbedError as e:
                entry = {"status": "failed", "detail": e.message}
            interrupt = entry.pop("_interrupt", None)
            folder.record(plan, **entry)
            if entry.get("seconds") is not None:
                durations.append(entry["seconds"])
            progress(f"run {plan.index} of {total}: {entry['status']}"
                     + (f" in {entry['seconds']:.0f} s" if entry.get("seconds") is not None else "")
                     + (f" ({entry['detail']})" if entry["status"] != "completed" and entry.get("detail") else ""))
            _tables(folder, progress, plots=False)
            if interrupt is not None:
                raise interrupt
    except KeyboardInterrupt:
        progress("interrupted: the runs done are kept; run the same command again to continue")
    finally:
        for s, h in old_handlers.items():
            signal.signal(s, h)
    summary = _tables(folder, progress, plots=plots)
    status = summary.get("status", {})
    outcome = Outcome(folder.path, total, status.get("completed", 0), status.get("failed", 0),
                      total - status.get("completed", 0) - status.get("failed", 0), summary)
    progress(f"{outcome.completed} of {total} runs completed, {outcome.failed} failed"
             + (f", {outcome.left} left" if outcome.left else "")
             + f"; table: {os.path.join(folder.path, table.CONFIGS_CSV)}")
    return outcome


def _tables(folder: SweepDir, progress: Progress, plots: bool) -> dict[str, Any]:
    try:
        return folder.tables(plots=plots)
    except (TestbedError, OSError) as e:
        progress(f"the sweep's table could not be written: {getattr(e, 'message', e)}")
        return {}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def analyze_sweep(sweep_dir: str, plots: bool = True) -> dict[str, Any]:
    """Rebuild the table and plots of the sweep folder ``sweep_dir`` from its files."""
    if not os.path.isfile(os.path.join(sweep_dir, table.PLAN_JSON)):
        raise ConfigError(f"{sweep_dir} is not a sweep folder (no {table.PLAN_JSON} in it)")
    return SweepDir(sweep_dir).tables(plots=plots)


def is_sweep_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, table.PLAN_JSON)) and os.path.isdir(path)
