"""The ``edgetb`` command: bring a network up, look at it, run commands in it, take it down.

    edgetb up links.json [--nodes nodes.json] [--runtime netns|docker] [--dry-run] [--open-network]
              [--replay-s S | --no-replay]   (links that replay a recording: in the foreground)
    edgetb status [--json]
    edgetb exec [--detach] [--env K=V]... [--as-root] NODE -- CMD [ARG ...]
    edgetb ps [NODE] [--json]
    edgetb logs ID [-f]
    edgetb stop ID
    edgetb shape show NODE [--json]
    edgetb shape set SRC DST RATE [--delay 20ms] [--jitter 5ms] [--loss 1%] [--queue 100]
    edgetb shape update links.json
    edgetb shape access NODE [--uplink RATE|none] [--downlink RATE|none]
    edgetb monitor [--period-ms 100] [--interval 1] [--csv DIR] [--duration S] [--top 10]
    edgetb down
    edgetb swarm check --hosts hosts.json [--nodes N|nodes.json|links.json]
    edgetb analyze RUN_DIR|SWEEP_DIR [--link SRC->DST] [--threshold cpu=20] [--no-plots] [--json]
    edgetb sweep FILE [--workdir DIR] [--check] [--retry-failed] [--no-plots]
    edgetb predict fit RUN_DIR... --out model.json
    edgetb predict INPUT_DIR --model model.json
    edgetb predict eval RUN_DIR... [--by config]

Without ``--agent`` the CLI drives this host directly (as root); with
``--agent URL`` it talks to a worker agent using the shared token.

On this host a testbed id has one owner (controller/workers/lock.py): ``up`` takes the id (refused
while a run script or another ``edgetb`` holds it, or while it is already up) and records the
testbed as kept, so that no run script removes it; ``down`` removes it (and what a crashed
holder left), refused only while a live process holds the id; ``status`` says who owns it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from controller.model.topology import Topology, access_rate, load_links, load_nodes
from controller.model.traces import replay_lines
from controller.calibration import host_kernel_s
from controller.run.trace_replay import replay_in_foreground, traced_links
from controller.workers import deploy
from controller.workers.api import Worker
from controller.workers.connect import connect, reset_stale
from worker.api.errors import ConfigError, NodeRuntimeError, TestbedError
from worker.api.protocol import DEFAULT_SUBNET
from worker.api.shape import tc_rate
from worker.shaping.plan import render


def _progress(message: str) -> None:
    print(f"edgetb: {message}", file=sys.stderr, flush=True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgetb", description="Emulate an edge network: nodes, shaped links, commands.")
    p.add_argument("--id", default=os.environ.get("EDGETB_ID", "0"), help="testbed id, 1-5 of [a-z0-9] (default 0)")
    p.add_argument("--subnet", default=os.environ.get("EDGETB_SUBNET", DEFAULT_SUBNET),
                   help=f"node subnet (default {DEFAULT_SUBNET})")
    p.add_argument("--agent", default=os.environ.get("EDGETB_AGENT"), help="worker agent URL (default: this host)")
    p.add_argument("--token-file", default=None,
                   help="the agent's token file, mode 0600 (default: $EDGETB_TOKEN, else state dir/token)")
    p.add_argument("--agent-fingerprint", default=os.environ.get("EDGETB_AGENT_FINGERPRINT"),
                   help="SHA-256 fingerprint of an https:// agent's certificate (its --print-fingerprint)")
    sub = p.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="create the nodes and shape the links of LINKS")
    up.add_argument("links", help="links.json: {src: [{dest, bw, delay, jitter, loss, queue}, ...]}")
    up.add_argument("--nodes", help="nodes file declaring names, cpu and mem (default: every node in LINKS)")
    up.add_argument("--runtime", choices=("netns", "docker"), default=None,
                    help="what a node is: a network namespace (default) or a Docker container")
    up.add_argument("--dry-run", action="store_true", help="print the plan as tc commands; needs no root")
    up.add_argument("--open-network", action="store_true",
                    help="let nodes that no link joins reach each other unshaped, as EdgeTB does "
                         "(default: no link, no path)")
    up.add_argument("--replay-s", type=float, default=None, metavar="SECONDS",
                    help="links that replay a recorded trace: replay for this long, then return (default: until "
                         "Ctrl-C, or until every recording that does not loop has ended)")
    up.add_argument("--no-replay", action="store_true",
                    help="return once the nodes are up: traced links keep their recording's first rate")

    st = sub.add_parser("status", help="list nodes, addresses, limits and shaping")
    st.add_argument("--json", action="store_true", help="print the status as JSON")

    ex = sub.add_parser("exec", help="run a command inside a node, as the node: edgetb exec NODE -- CMD ...")
    ex.add_argument("--detach", "-d", action="store_true",
                    help="start it in the background and print its process id (see ps, logs, stop)")
    ex.add_argument("--env", "-e", action="append", default=[], metavar="K=V",
                    help="set an environment variable of the command (repeatable)")
    ex.add_argument("--as-root", action="store_true",
                    help="this host only, attached: run as root in the node's network namespace and cgroups, "
                         "without its uid, file view, rlimits and seccomp filter")
    ex.add_argument("node", help="the node to run it in")
    ex.add_argument("argv", nargs=argparse.REMAINDER, help="the command and its arguments, after --; its exit "
                                                          "code is edgetb's")
    ps = sub.add_parser("ps", help="list the processes started in nodes (exec --detach, the run's own)")
    ps.add_argument("node", nargs="?", help="only this node's processes (default: every node's)")
    ps.add_argument("--json", action="store_true", help="print the process records as JSON")
    lg = sub.add_parser("logs", help="print what a process wrote (its output and errors), control characters removed")
    lg.add_argument("proc_id", metavar="ID", help="the process id (exec --detach printed it; ps lists them)")
    lg.add_argument("--follow", "-f", action="store_true",
                    help="keep printing what it writes until it ends (Ctrl-C stops reading, not the process)")
    sp = sub.add_parser("stop", help="stop a process: SIGTERM to its process group, SIGKILL after 5 s")
    sp.add_argument("proc_id", metavar="ID", help="the process id (exec --detach printed it; ps lists them)")

    sh = sub.add_parser("shape", help="show or change a node's shaping")
    shs = sh.add_subparsers(dest="shape_command", required=True)
    show = shs.add_parser("show", help="the node's plan and what the kernel holds")
    show.add_argument("node", help="the node whose shaping is shown")
    show.add_argument("--json", action="store_true", help="print plan, kernel state and mismatches as JSON")
    put = shs.add_parser("set", help="change one directed link in place, while traffic flows")
    put.add_argument("src", help="the link's source node")
    put.add_argument("dst", help="the link's destination node")
    put.add_argument("rate", help="e.g. 5mbit (bits/s) or 5mbps (BYTES/s, as in tc)")
    put.add_argument("--delay", help="e.g. 20ms (needs sch_netem)")
    put.add_argument("--jitter", help="e.g. 5ms, with a delay (needs sch_netem)")
    put.add_argument("--loss", help="e.g. 0.5%% (needs sch_netem)")
    put.add_argument("--queue", type=int, help="the link's queue in packets")
    acc = shs.add_parser("access", help="change a node's access links (shared by all its peers) in place")
    acc.add_argument("node", help="the node whose access links change")
    acc.add_argument("--uplink", help="e.g. 10mbit, or none to remove it (default: keep)")
    acc.add_argument("--downlink", help="e.g. 10mbit, or none to remove it (default: keep)")
    upd = shs.add_parser("update", help="re-shape every link from an edited links file, in place")
    upd.add_argument("links", help="the edited links file")
    upd.add_argument("--nodes", help="nodes file declaring names, cpu and mem (default: every node in LINKS)")

    sc = sub.add_parser("scenario", help="play a scenario's timeline against the testbed, printing each event")
    sc.add_argument("file", help="scenario.json: {seed, time_scale, events: [...]}")
    sc.add_argument("--links", help="--dry-run: the links file to check against (default links.json); a "
                                    "scenario played is checked against the testbed that is up")
    sc.add_argument("--nodes", help="--dry-run: nodes file declaring names, cpu and mem")
    sc.add_argument("--dry-run", action="store_true", help="print the timeline, every draw resolved; needs no root")
    sc.add_argument("--csv", help="also write the applied events to this CSV file")
    mon = sub.add_parser("monitor", help="sample the testbed's nodes and links: a live table, CSV files on request")
    mon.add_argument("--period-ms", type=int, default=100, help="sampling period in ms (10-10000, default 100)")
    mon.add_argument("--interval", type=float, default=1.0, help="seconds between table refreshes (default 1)")
    mon.add_argument("--csv", metavar="DIR", help="also write telemetry/links.csv.gz, nodes.csv.gz and hosts.csv.gz in DIR")
    mon.add_argument("--duration", type=float, default=None, help="stop after this many seconds (default: Ctrl-C)")
    mon.add_argument("--top", type=int, default=10, help="busiest links shown (default 10)")

    down = sub.add_parser("down", help="remove every node, link and rule of this testbed")
    down.add_argument("--runtime", choices=("netns", "docker"), default=None,
                      help="the kind of nodes to look for when the state file is lost (default: as recorded)")
    sw = sub.add_parser("swarm", help="the swarm fabric of a hosts file")
    sws = sw.add_subparsers(dest="swarm_command", required=True)
    swc = sws.add_parser("check", help="can the hosts form the swarm overlay? read-only: changes nothing")
    swc.add_argument("--hosts", required=True, help="hosts.json (engine, overlay_subnet, overlay_mtu, hosts)")
    swc.add_argument("--nodes", help="the number of nodes, or a nodes or links file to count them from")
    dash = sub.add_parser("dashboard", help="serve the dashboard of the stored runs in WORKDIR/dml_file/log/")
    dash.add_argument("--workdir", default=".", help="the experiment directory (default: here)")
    dash.add_argument("--port", type=int, default=3333, help="port on 127.0.0.1 (default 3333)")
    swp = sub.add_parser("sweep", help="run an experiment as a series: a grid of configurations times repeats, "
                                       "one run after another, with a table of means and intervals")
    swp.add_argument("file", help="the sweep file (docs/reference/sweep-files.md)")
    swp.add_argument("--workdir", help="the experiment directory (default: the sweep file's)")
    swp.add_argument("--check", action="store_true", help="check the sweep file and every run's files, list the "
                                                          "runs, run nothing")
    swp.add_argument("--retry-failed", action="store_true", help="run the failed runs of an earlier sweep again")
    swp.add_argument("--no-plots", action="store_true", help="the sweep's tables only")
    an = sub.add_parser("analyze", help="the traffic and burst metrics of a finished run, into RUN_DIR/analysis/; "
                                        "of a sweep folder, its table and plots again")
    an.add_argument("run_dir", help="a run folder (dml_file/log/<run id>), or a sweep folder")
    an.add_argument("--link", action="append", default=[], metavar="SRC->DST",
                    help="plot this link's throughput (repeatable; default: the busiest links)")
    an.add_argument("--threshold", action="append", default=[], metavar="RESOURCE=VALUE",
                    help="a fixed burst threshold for cpu (%%), mem (bytes), net_tx or net_rx (bit/s) instead of "
                         "the 2-means rule (repeatable)")
    an.add_argument("--no-plots", action="store_true", help="tables and summary only")
    an.add_argument("--json", action="store_true", help="print the summary as JSON")
    from controller.predict.cli import add_parser as add_predict

    add_predict(sub)
    return p


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run a sweep file (controller/sweep.py); ``--check``: check it and list its runs."""
    from controller import sweep

    if args.check:
        found = sweep.load_sweep(args.file, args.workdir)
        sweep.check(found)
        for plan in found.runs:
            algorithm = "" if "algorithm" in plan.params else f"{found.algorithm_of(plan)}, "
            print(f"run {plan.index} ({plan.name}): {algorithm}{sweep.describe(plan) or 'the base files'}")
        print(f"{len(found.runs)} runs, every file valid; the sweep folder: {found.out}")
        return 0
    outcome = sweep.run_sweep(args.file, args.workdir, retry_failed=args.retry_failed, plots=not args.no_plots)
    return outcome.exit_code


def cmd_analyze(args: argparse.Namespace) -> int:
    from controller.results.analysis import AnalysisConfig, analyze
    from controller.results.analysis.report import RESOURCES
    from controller.sweep import analyze_sweep, is_sweep_dir

    if is_sweep_dir(args.run_dir):
        done = analyze_sweep(args.run_dir, plots=not args.no_plots)
        if args.json:
            print(json.dumps(done, indent=1, default=str))
            return 0
        print(f"sweep {args.run_dir}: {done['runs']} runs, {done['configurations']} configurations "
              f"({', '.join(f'{n} {s}' for s, n in done['status'].items() if n)}); "
              f"{', '.join(done['files'])}, {len(done['plots'])} plots")
        for problem in done["problems"]:
            print(f"  problem: {problem}")
        return 0

    thresholds = {}
    for item in args.threshold:
        name, _, value = item.partition("=")
        if name not in RESOURCES:
            raise ConfigError(f"--threshold {item!r}: the resource must be one of {', '.join(RESOURCES)}")
        try:
            thresholds[name] = float(value)
        except ValueError:
            raise ConfigError(f"--threshold {item!r}: {value!r} is not a number") from None
    for link in args.link:
        if "->" not in link:
            raise ConfigError(f"--link {link!r}: write a link as SRC->DST")
    config = AnalysisConfig(thresholds=thresholds, links=args.link, plots=not args.no_plots)
    try:
        summary = analyze(args.run_dir, config, progress=_progress)
    except OSError as e:
        raise ConfigError(f"cannot analyse {args.run_dir}: {e.strerror or e} ({e.filename or args.run_dir})") from None
    if args.json:
        print(json.dumps(summary, indent=1, default=str))
        return 0
    fid = summary["fidelity"]
    print(f"run {summary['run_id']}: analysis in {os.path.join(args.run_dir, 'analysis')} "
          f"({summary['seconds']:.1f}s)")
    if summary["missing"]:
        print(f"  missing: {', '.join(summary['missing'])}")
    for problem in summary["problems"]:
        print(f"  problem: {problem}")
    t = summary["throughput"].get("1s")
    if t and t.get("mean") is not None:
        ci = f" ± {t['ci95'] / 1e6:.3f}" if t.get("ci95") is not None else ""
        print(f"  aggregate throughput (1 s, steady window): {t['mean'] / 1e6:.3f}{ci} Mbit/s, "
              f"peak {t['peak_bps'] / 1e6:.3f} Mbit/s")
    if summary["flows"].get("n_flows") is not None:
        print(f"  flows: {summary['flows']['n_flows']}")
    print(f"  traffic matrix from {summary['traffic_matrix_source']}")
    verdict = {True: "pass", False: "FAIL", None: "not checked"}[fid["ok"]]
    print(f"  fidelity: {verdict} ({fid['passed']} of {fid['checked']} checks)")
    for name in summary["files"]:
        print(f"  {name}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from controller.web.dashboard import create_viewer
    from controller.web.run_view import list_runs, log_root
    from worker.serving import serve

    runs = list_runs(args.workdir)
    if not runs:
        raise ConfigError(f"no run in {log_root(args.workdir)}: give the experiment directory with --workdir")
    _progress(f"{len(runs)} runs in {log_root(args.workdir)}; dashboard on http://localhost:{args.port}/ "
              "(Ctrl-C stops it)")
    try:
        serve(create_viewer(args.workdir), args.port, "127.0.0.1")
    except OSError as e:
        raise ConfigError(f"cannot listen on 127.0.0.1:{args.port}: {e.strerror or e}") from None
    return 0


def _worker(args: argparse.Namespace) -> Worker:
    if args.agent:
        from worker.agent import load_token

        client = connect(agent=args.agent, token=load_token(args.token_file, create=False),
                         fingerprint=args.agent_fingerprint)
        wanted = getattr(args, "runtime", None)
        if wanted and (kind := client.capabilities().get("runtime", "netns")) != wanted:
            raise ConfigError(f"the agent at {args.agent} makes {kind} nodes; start it with --runtime {wanted}")
        return client
    if os.geteuid() != 0:
        raise ConfigError("driving this host needs root (sudo), or use --dry-run / --agent URL")
    return connect(args.id, args.subnet, runtime=getattr(args, "runtime", None))


def _topology(links: str, nodes: Optional[str]) -> Topology:
    declared = load_nodes(nodes, host_kernel_s) if nodes else None
    return load_links(links, declared, nodes_declared=declared is not None)


def _fmt_mem(mem_bytes: Optional[int]) -> str:
    if not mem_bytes:
        return "-"
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if mem_bytes % size == 0:
            return f"{mem_bytes // size}{unit}"
    return str(mem_bytes)


def cmd_up(args: argparse.Namespace) -> int:
    topology = _topology(args.links, args.nodes)
    if args.dry_run:
        ips = deploy.planned_ips(topology, args.subnet)
        for name, node in topology.nodes.items():
            device = (f" device={node.device['class']} slowdown={node.device['slowdown']:g}"
                      f" effective={node.device['effective_slowdown']:g}" if node.device else "")
            print(f"# node {name}: {ips[name]}  cpu={node.cpu or '-'} mem={_fmt_mem(node.mem_bytes)}{device}")
        space = None if args.open_network else deploy.node_space(topology, ips, [args.subnet])
        for src, plan in deploy.plans(topology, ips, space).items():
            print("\n".join(render(plan, f"etb-{args.id}-{src}")))
        for link in traced_links(topology):
            arrow = f"{link.src}->{link.dst}" if link.side is None else f"{link.src} {link.side}"
            print(f"# trace {arrow}: {link.replay.describe()}\n#   {replay_lines(link.replay)[0]}")
        return 0
    if args.replay_s is not None and not (math.isfinite(args.replay_s) and args.replay_s > 0):
        raise ConfigError(f"--replay-s must be a number of seconds > 0, got {args.replay_s:g}")
    lock = _local_lock(args)
    if lock is None:
        worker = _worker(args)
        result = deploy.deploy(topology, worker, _progress, open_network=args.open_network)
    else:
        from controller.workers.lock import Holder

        found = lock.take(Holder.this_process(runtime=args.runtime, subnet=args.subnet))
        clean = False
        try:
            if found.state == "stale":
                _progress(f"{found.stale_message()}: removing its namespaces, links and node processes")
                reset_stale(args.id, args.subnet, found)
            worker = _worker(args)
            result = deploy.deploy(topology, worker, _progress, open_network=args.open_network)  # all or nothing
            lock.mark_kept()
        except BaseException:
            clean = not lock.resources_left()
            raise
        finally:
            lock.release(forget=clean)
    _print_status(worker.status())
    _progress(f"up: {len(result['nodes'])} nodes; they stay up until 'edgetb --id {args.id} down'; "
              "try 'edgetb exec NODE -- CMD'")
    links = traced_links(topology)
    if links and not args.no_replay:
        _progress(f"replaying the recordings of {len(links)} links from now "
                  + (f"for {args.replay_s:g} s" if args.replay_s else "until Ctrl-C")
                  + ": the nodes stay up after it")
        replay_in_foreground(worker, links, args.replay_s, _progress)
    return 0


def _local_lock(args: argparse.Namespace) -> Any:
    """The lock of the testbed id on this host (None when an agent drives another host)."""
    if args.agent:
        return None
    if os.geteuid() != 0:
        raise ConfigError("driving this host needs root (sudo), or use --dry-run / --agent URL")
    from controller.workers.lock import TestbedLock

    return TestbedLock(args.id)


def _print_status(status: dict[str, Any]) -> None:
    print(f"testbed {status['testbed_id']}  subnet {status.get('subnet') or '-'}  "
          f"bridge {status.get('bridge') or '-'} {status.get('bridge_ip') or ''}  "
          f"processes running {status['processes_running']}")
    owner = status.get("owner")
    if owner and owner["state"] != "free":
        print(f"owner: {_owner_text(status['testbed_id'], owner)}")
    rows = [("NODE", "IP", "CPU", "MEM", "LINKS", "SHAPED")]
    for n in status["nodes"]:
        rows.append((n["name"], n["ip"], f"{n['cpu']:g}" if n["cpu"] else "-", _fmt_mem(n["mem_bytes"]),
                     str(n["links"]), "yes" if n["shaped"] else "no"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())


def cmd_status(args: argparse.Namespace) -> int:
    status = _worker(args).status()
    lock = _local_lock(args)
    if lock is not None:
        status["owner"] = lock.look().to_dict()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        _print_status(status)
    return 0


def cmd_exec(args: argparse.Namespace) -> int:
    """Run a command in a node as the node (its uid, file view, cgroups, rlimits, seccomp):
    attached, its exit code edgetb's; ``--detach``: in the background, its id printed."""
    from controller.workers import programs

    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise ConfigError("give a command after the node: edgetb exec NODE -- CMD ...")
    env = programs.check_env(args.env)
    if args.as_root and (args.detach or args.agent):
        raise ConfigError("--as-root is for an attached command on this host (no --detach, no --agent)")
    if args.detach:
        if args.agent:
            record = programs.start(_worker(args), args.node, argv, env)
        else:
            _local_lock(args)  # (root, or a clear error)
            record = programs.start_local(lambda: _worker(args), args.node, argv, env)
        print(record["id"])
        _progress(f"started {argv[0]!r} in {args.node} as process {record['id']}: 'edgetb logs {record['id']} -f' "
                  f"reads its output, 'edgetb stop {record['id']}' stops it")
        return 0
    worker = _worker(args)
    from worker.host import WorkerHost

    if not isinstance(worker, WorkerHost):
        return _exec_through_agent(worker, args.node, argv, env)
    if args.as_root:  # this terminal's process group: Ctrl-C reaches the command from the terminal
        code = _run_attached(lambda: worker.runtime.popen(args.node, argv, **({"env": {**os.environ, **env}}
                                                                             if env else {})), group=False)
    else:
        code = _run_attached(lambda: worker.popen(args.node, argv, env), group=True)
    return 128 - code if code < 0 else code


EXEC_GRACE_S = 5.0  # from the first signal passed on to SIGKILL


def _exec_through_agent(worker: Worker, node: str, argv: list[str], env: dict[str, str]) -> int:
    """An attached command on an agent's node: started as a recorded process whose log (output
    and errors, as one stream) is printed as it grows; SIGINT, SIGTERM or SIGHUP stop it there."""
    from controller.workers import programs

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    before = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    record: Optional[dict[str, Any]] = None
    stopped: dict[str, Any] = {}
    reader = programs.LogReader()
    try:
        record = programs.start(worker, node, argv, env)
        for text in programs.follow(worker, record["id"], reader=reader):
            sys.stdout.write(text)
            sys.stdout.flush()
        code = programs.find(worker, record["id"]).get("returncode")
    except KeyboardInterrupt:
        if record is None:
            raise
        code = None
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if record is not None:  # stopped when it runs, forgotten in any case; what it wrote as it stopped printed
            stopped = worker.stop_process(node, record["id"], reader.offset)
            if "log" in stopped:
                sys.stdout.write(reader.feed(stopped["log"]) + reader.end())
                sys.stdout.flush()
    if code is None:
        code = stopped.get("returncode")
    if code is None:
        raise NodeRuntimeError(f"{argv[0]!r} in {node}: its exit code is unknown (the agent was restarted?)")
    return 128 - code if code < 0 else code


def _in_foreground() -> bool:
    """Whether this process's group owns the terminal (then Ctrl-C reaches its whole group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _run_attached(start: Callable[[], subprocess.Popen], group: bool) -> int:
    """Start an attached command and wait for it; SIGINT, SIGTERM and SIGHUP sent to edgetb are
    passed on (to its process group when it leads one), and SIGKILL follows ``EXEC_GRACE_S`` after
    the first. Caught before the start, they are not ignored by the command (as by one started in
    the background of a shell)."""
    received: list[int] = []
    forward_int = group or not _in_foreground()
    child: Optional[subprocess.Popen] = None

    def send(sig: int) -> None:
        if child is None:
            return
        try:
            os.killpg(child.pid, sig) if group else child.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        if signum != signal.SIGINT or forward_int:
            send(signum)

    caught = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    before = {sig: signal.signal(sig, on_signal) for sig in caught}
    deadline: Optional[float] = None
    try:
        child = start()
        if received:  # a signal came while it started
            send(received[0])
        while True:
            try:
                code = child.wait(timeout=0.1)
                if received and group:  # what it left in its group (a job of a shell) goes too
                    send(signal.SIGTERM)
                return code
            except subprocess.TimeoutExpired:
                if received and deadline is None:
                    deadline = time.monotonic() + EXEC_GRACE_S
                if deadline is not None and time.monotonic() > deadline:
                    send(signal.SIGKILL)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def cmd_ps(args: argparse.Namespace) -> int:
    from controller.workers import programs

    found = programs.processes(_worker(args), args.node)
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    rows = [("ID", "NODE", "PID", "STATE", "STARTED", "COMMAND")]
    for p in found:
        state = "running" if p.get("running") else f"exited {p['returncode']}" if p.get("returncode") is not None \
            else "ended"
        started = time.strftime("%H:%M:%S", time.localtime(p["started"])) if p.get("started") else "-"
        rows.append((p["id"], p["node"], str(p["pid"]), state, started, programs.printable(" ".join(p["argv"]))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip())
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from controller.workers import programs

    try:
        for text in programs.follow(_worker(args), args.proc_id, keep_following=args.follow):
            sys.stdout.write(text)
            sys.stdout.flush()
    except KeyboardInterrupt:  # stops reading; the process runs on
        return 0
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    from controller.workers import programs

    answer = programs.stop(_worker(args), args.proc_id)
    code = answer.get("returncode")
    print(f"stopped {args.proc_id}" + (f" (exit code {code})" if code is not None else ""))
    return 0


def cmd_shape(args: argparse.Namespace) -> int:
    worker = _worker(args)
    if args.shape_command == "show":
        info = worker.shaping(args.node)
        if args.json:
            print(json.dumps(info, indent=2))
            return 0 if info["verified"] or not info["plan"] else 1
        _print_shaping(info)
        return 0 if info["verified"] or not info["plan"] else 1
    if args.shape_command == "set":
        topo = Topology()
        for name in (args.src, args.dst):
            topo.add_node(name)
        topo.add_link(args.src, args.dst, args.rate, delay=args.delay, jitter=args.jitter, loss=args.loss,
                      queue=args.queue)
        result = deploy.update_links(topo, worker, _progress, only={(args.src, args.dst)})
    elif args.shape_command == "access":
        sides = {f"{side}_bps": None if text.lower() == "none" else access_rate(text, f"--{side}")
                 for side, text in (("uplink", args.uplink), ("downlink", args.downlink)) if text is not None}
        if not sides:
            raise ConfigError("shape access: give --uplink and/or --downlink (a rate, or none)")
        result = deploy.set_access(worker, args.node, sides)
    else:
        result = deploy.update_links(_topology(args.links, args.nodes), worker, _progress)
    for node in result["nodes"]:
        for line in node.get("changed") or []:
            print(f"{node['node']}: {line}")
    _progress(f"updated and verified in {result['seconds']:.3f} s")
    return 0


MAX_FLOW_WAIT_S = 86_400


def cmd_scenario(args: argparse.Namespace) -> int:
    """Validate and resolve the scenario (``--dry-run``: print it), else play its timed steps now
    against the running testbed and return once the last one is applied."""
    from controller.model.scenario import load_scenario
    from controller.run.scenario_runner import ScenarioRunner

    if args.dry_run:
        topology = _topology(args.links or "links.json", args.nodes)
        timeline = load_scenario(args.file, topology)
        print("\n".join(timeline.render()))
        if topology.traces:
            from controller.model.traces import replay_lines

            print(f"{args.links or 'links.json'}: {len(topology.traces)} links replay a trace from the run's start")
            for (src, dst), replay in topology.traces.items():
                print(f"  {src}->{dst}: {replay.describe()}")
                print("".join(f"    {line}" for line in replay_lines(replay)))
        return 0
    if args.links or args.nodes:
        raise ConfigError("--links and --nodes are for --dry-run: a scenario is played against the topology of "
                          f"testbed {args.id} as it is up")
    worker = _worker(args)
    timeline = load_scenario(args.file, deploy.live_topology(worker))
    nodes = worker.status()["nodes"]
    ips = {n["name"]: n["ip"] for n in nodes}
    if timeline.replays and any(n["runtime"] != "physical" and not n.get("gso_max_bytes") for n in nodes):
        _progress("warning: this testbed's nodes were made with 64 KB segments (no recording in its links.json): "
                  "after a gap of a replayed recording a bulk flow can stall for up to a minute (the traces "
                  "how-to, 'A quiet stretch')")
    rounds = sum(len(v) for v in timeline.by_round().values())
    if rounds:
        _progress(f"{rounds} steps wait for a node's round: they apply only during a run (--scenario of a run script)")
    runner = ScenarioRunner(timeline, worker, ips, progress=lambda line: print(line, flush=True))
    timed = len(timeline.timed())
    _progress(f"playing {timed} steps over {runner.last_at_s:g} s")
    runner.start()
    try:
        while not runner.wait(1.0) or not runner.replay.done():  # (a looped trace: until interrupted)
            pass
        if runner.flows:  # flows run in this process when it drives this host: they end first
            _progress("waiting for the background flows to end")
            runner.wait_flows(MAX_FLOW_WAIT_S)
        notice = max((s.params.get("notice_s", 0) for s in timeline.steps if s.kind == "revoke"), default=0)
        time.sleep(notice)  # the SIGKILL after a revocation's notice
    finally:
        runner.stop()
    if args.csv:
        with open(args.csv, "w", encoding="utf-8") as f:
            f.write(runner.csv_text())
    failed = [r for r in runner.rows if r["outcome"].startswith("failed")]
    skews = sorted(r["skew_ms"] for r in runner.rows)
    if skews:
        _progress(f"{len(runner.rows)} steps applied, median skew {skews[len(skews) // 2]:.1f} ms, "
                  f"{len(failed)} failed")
    return 1 if failed else 0


def _print_shaping(info: dict[str, Any]) -> None:
    kernel = info["kernel"]
    print(f"# node {info['node']}: kernel tc state of eth0")
    root = kernel.get("root")
    if not root:
        print("qdisc: none (unshaped)")
    else:
        print(f"qdisc {root['kind']} 1: root default {root.get('default_minor')}")
        for cls, data in kernel["classes"].items():
            leaf = kernel["leaves"].get(cls)
            leaf_text = f"  leaf {json.dumps(leaf, sort_keys=True)}" if leaf else ""
            ceil = f" ceil {tc_rate(data['ceil_bps'])}" if data.get("ceil_bps") not in (None, data["rate_bps"]) else ""
            parent = f" parent {data['parent']}" if data.get("parent") else ""
            name = "  (access: the uplink)" if cls == "1:3" else ""
            print(f"class {cls}{parent} rate {tc_rate(data['rate_bps'])}{ceil}{leaf_text}{name}")
        for handle, f in kernel["filters"].items():
            print(f"filter {handle} match ip dst {f['dest_ip']}/32 -> class 1:{f['minor']:x}")
        for prefix, f in kernel.get("drops", {}).items():
            print(f"filter prio 2 match ip dst {prefix} -> class 1:{f['minor']:x} (isolation: dropped)")
        if kernel.get("ipv6_drop"):
            print(f"filter prio 3 protocol ipv6 -> class 1:{kernel['ipv6_drop']['minor']:x} (isolation: dropped)")
    down = kernel.get("downlink") or {}
    if down.get("rate_bps") or down.get("redirect"):
        rate = tc_rate(down["rate_bps"]) if down.get("rate_bps") else "none"
        print(f"downlink {rate}: ingress redirected to an IFB: {'yes' if down.get('redirect') else 'NO'}")
        peers = down.get("peers") or {}
        if peers or down.get("default_bps"):
            share = tc_rate(down["default_bps"]) if down.get("default_bps") else "none"
            print(f"  shared by {len(peers)} peers and the default class, each guaranteed {share}")
    if info["plan"]:
        print(f"# plan ({len(info['plan']['rules'])} links):")
        print("\n".join(info["tc"]))
        print("verified: yes" if info["verified"] else "verified: NO\n  " + "\n  ".join(info["mismatches"]))


def _owner_text(testbed_id: str, owner: dict[str, Any]) -> str:
    from controller.workers.lock import Holder

    holder = Holder.from_dict(owner.get("holder"))
    who = holder.describe() if holder else "no recorded process"
    return {"busy": f"in use by {who}",
            "kept": f"brought up by {who}; stays up until 'edgetb --id {testbed_id} down'",
            "stale": f"left by {who}, which is gone; remove it with 'edgetb --id {testbed_id} down'",
            "unowned": f"nodes that no recorded process owns; remove them with 'edgetb --id {testbed_id} down'",
            }.get(owner["state"], owner["state"])


def cmd_down(args: argparse.Namespace) -> int:
    """Remove the testbed, unless a live process (a run script, another edgetb) holds its id."""
    lock = _local_lock(args)
    if lock is None:
        removed = _worker(args).reset()["removed"]
    else:
        found = lock.take_to_remove()
        clean = False
        try:
            if found.state == "stale":
                _progress(f"{found.stale_message()}: removing its namespaces, links and node processes")
                if found.holder and found.holder.details.get("hosts"):
                    _progress(f"it also ran nodes on the hosts of {found.holder.details['hosts']}: remove those "
                              f"with 'edgetb --agent URL --id {args.id} down' for each host")
            elif found.holder is not None:
                _progress(f"removing testbed {args.id}, brought up by {found.holder.describe()}")
            if found.state == "stale":
                removed = reset_stale(args.id, args.subnet, found, runtime=args.runtime)
            else:
                removed = _worker(args).reset()["removed"]
            clean = True
        finally:
            lock.release(forget=clean)
    _progress(f"down: removed {removed['nodes']} nodes and every resource of testbed {args.id}")
    return 0


def cmd_monitor(args: argparse.Namespace) -> int:
    """Sample a running testbed until Ctrl-C (or ``--duration``): a live table, CSV on request.
    Times in the CSV files are seconds since the monitor started."""
    import time

    from controller.results.rates import LinkRates
    from controller.results.run_dir import RunDir
    from controller.telemetry.collector import Collector
    from controller.telemetry.export import configured_rates, render_table
    from controller.model.telemetry_conf import TelemetryConf

    conf = TelemetryConf(period_ms=args.period_ms)
    if args.interval <= 0 or (args.duration is not None and args.duration <= 0) or args.top < 0:
        raise ConfigError("--interval and --duration must be positive, --top 0 or more")
    worker = _worker(args)
    if not worker.status()["nodes"]:
        raise ConfigError(f"testbed {args.id} has no nodes: bring it up first (edgetb up links.json)")
    out = RunDir(args.csv) if args.csv else None
    collector = Collector(worker, conf, out, LinkRates(configured_rates(worker)), pull_interval_s=args.interval)
    collector.start()
    collector.mark_start()
    tty = sys.stdout.isatty()
    deadline = None if args.duration is None else time.monotonic() + args.duration
    try:
        while deadline is None or time.monotonic() < deadline:
            wait = args.interval if deadline is None else max(0.0, min(args.interval, deadline - time.monotonic()))
            time.sleep(wait)
            collector.pull()
            table = render_table(collector, args.top)
            stamp = f"testbed {args.id}, sampled every {conf.period_ms} ms"
            print(("\x1b[H\x1b[2J" if tty else "") + stamp + "\n" + table + ("" if tty else "\n"), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        summary = collector.finish()
    if out is not None:
        _progress(f"telemetry written in {os.path.join(out.path, 'telemetry')} ({summary['rows']})")
    return 0


def cmd_predict(args: argparse.Namespace) -> int:
    """Fit, predict or cross-validate (controller/predict/cli.py); no root, no testbed."""
    from controller.predict.cli import run as run_predict

    return run_predict(args)


def cmd_swarm(args: argparse.Namespace) -> int:
    """Check that the hosts can form the swarm fabric (controller/swarm_check.py): 0 when every
    check passes, 2 when one fails."""
    from controller import swarm_check

    rows = swarm_check.check(args.hosts, args.nodes)
    print(swarm_check.render(rows))
    return swarm_check.exit_code(rows)


COMMANDS = {"up": cmd_up, "status": cmd_status, "exec": cmd_exec, "ps": cmd_ps, "logs": cmd_logs, "stop": cmd_stop,
            "shape": cmd_shape, "scenario": cmd_scenario,
            "monitor": cmd_monitor, "analyze": cmd_analyze, "sweep": cmd_sweep, "dashboard": cmd_dashboard, "down": cmd_down,
            "predict": cmd_predict, "swarm": cmd_swarm}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("up", "down") and threading.current_thread() is threading.main_thread():  # a kill or a closed terminal mid-way: up removes what it made
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _interrupt)
    try:
        return COMMANDS[args.command](args)
    except TestbedError as e:
        print(f"edgetb: error: {e.message}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:
        print("edgetb: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except subprocess.SubprocessError as e:  # pragma: no cover
        print(f"edgetb: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
