"""What ``gl_run.py`` (and ``fl_run.py`` ...) do: validate, make confs, deploy,
serve the controller on :3333 until reset; with ``--auto``, drive the whole run.

The command line is parsed into ``RunOptions`` (``parse_options``; the Testbed API builds them
directly), ``prepare`` resolves them into a ``RunSpec`` (controller/model/spec.py) and ``run``
runs it.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any, Optional

from controller.model.hosts import Hosts, check_placement, load_hosts
from controller.model.spec import RunOptions, RunSpec
from controller.model.topology import load_links, load_nodes
from controller.calibration import host_kernel_s
from controller.results import tables
from controller.run.experiment import Experiment
from controller.run.nodes import Nodes
from controller.web.app import create_app
from controller.web.live import LiveFeed
from controller.workers.api import Worker
from controller.workers.connect import connect, reset_stale
from worker.api.errors import ConfigError, TestbedError
from worker.api.protocol import DEFAULT_SUBNET
from worker.serving import Servers, run_blocking


def _say(message: str) -> None:
    try:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
    except OSError:  # the terminal went away (SIGHUP): the teardown still has to run
        pass


def _parser(algorithm: str, structure_default: str, dataset_default: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"{algorithm} learning on emulated nodes of this host")
    p.add_argument("--workdir", default=os.getcwd(), help="experiment directory (default: the current one)")
    p.add_argument("--links", default="links.json", help="links file, in the experiment directory (default links.json)")
    p.add_argument("--nodes", help="nodes file with cpu/mem limits (default: every node in links.json)")
    p.add_argument("-s", "--structure", default=structure_default,
                   help=f"structure file, in the experiment directory (default {structure_default})")
    p.add_argument("-d", "--dataset", default=dataset_default,
                   help=f"dataset file, in the experiment directory (default {dataset_default})")
    p.add_argument("--port", type=int, default=3333, help="controller port (default 3333)")
    p.add_argument("--admin-token-file", metavar="FILE",
                   help="the controller's admin token (mode 0600): with it, any local caller may change the "
                        "testbed; taken on loopback only (from another machine: an SSH tunnel) "
                        "(default: none; loopback callers who are root or the sudo user may)")
    p.add_argument("--listen", action="append", default=[], metavar="ADDRESS",
                   help="also serve the controller on this address of the host (repeatable; by default "
                        "only on 127.0.0.1 and the address nodes reach it by)")
    p.add_argument("--id", default=os.environ.get("EDGETB_ID", "0"), help="testbed id (default 0)")
    p.add_argument("--subnet", default=os.environ.get("EDGETB_SUBNET", DEFAULT_SUBNET),
                   help=f"the nodes' address space, one /16 per testbed (default {DEFAULT_SUBNET})")
    p.add_argument("--runtime", choices=("netns", "docker"), default="netns",
                   help="single host: what a node is, a network namespace or a Docker container (default netns)")
    p.add_argument("--hosts", help="hosts file: run on several worker hosts (see controller/model/hosts.py)")
    p.add_argument("--auto", action="store_true", help="run the whole flow, print a summary, reset")
    p.add_argument("--check", action="store_true", help="validate every file, write the shards and confs and try your "
                                                        "own code in the sandbox, then stop: no node is made")
    p.add_argument("--timeout", type=float, default=900.0, help="--auto: seconds to wait for the run (default 900)")
    p.add_argument("--verbose", action="store_true", help="print every node's round lines besides the aggregate")
    p.add_argument("--quiet-nodes", action="store_true", help="(the default) print one aggregate line per round "
                                                              "or 5 s, not each node's lines")
    p.add_argument("--scenario", help="scenario file: events applied while the run goes on (see controller/model/scenario.py)")
    p.add_argument("--open-network", action="store_true",
                   help="let nodes that no link joins reach each other unshaped, as EdgeTB does "
                        "(default: no link, no path)")
    from controller.model.telemetry_conf import add_arguments

    add_arguments(p)
    return p


def parse_options(argv: Optional[list[str]], algorithm: str, structure_default: str,
                  dataset_default: str) -> RunOptions:
    """A run script's command line (``argv``, default sys.argv) as RunOptions."""
    args = _parser(algorithm, structure_default, dataset_default).parse_args(argv)
    return RunOptions(algorithm=algorithm, workdir=os.path.realpath(args.workdir), links=args.links, nodes=args.nodes,
                      structure=args.structure, dataset=args.dataset, port=args.port,
                      admin_token_file=args.admin_token_file, listen=tuple(args.listen), testbed_id=args.id,
                      subnet=args.subnet, runtime=args.runtime, hosts=args.hosts, auto=args.auto,
                      check=args.check, timeout_s=args.timeout, verbose=args.verbose, scenario=args.scenario,
                      open_network=args.open_network, telemetry_period_ms=args.telemetry_period_ms,
                      telemetry=not args.no_telemetry, capture=args.capture)


def prepare(options: RunOptions) -> RunSpec:
    """Load and validate everything, write shards and confs; nothing is created on the network."""
    from controller.workers.deploy import planned_ips
    from controller.confs import usercode
    from controller.confs.confs import dataset_confs, load_dataset, load_structure, structure_confs, write_confs
    from controller.model.telemetry_conf import from_structure_file, resolve

    o, path = options, options.path
    topology = o.topology
    if topology is None:
        declared = load_nodes(path(o.nodes), host_kernel_s) if o.nodes else None
        topology = load_links(path(o.links), declared, nodes_declared=declared is not None)
    hosts = load_hosts(path(o.hosts)) if o.hosts else Hosts.single(o.runtime, topology)
    placement = check_placement(topology, hosts, o.hosts or "the single-host default (use --hosts for "
                                                           "physical nodes and other hosts)")
    structure = load_structure(path(o.structure), topology, o.algorithm)
    settings = load_dataset(path(o.dataset))
    user_files = usercode.stage(o.workdir, structure, path(o.structure))
    s_confs = structure_confs(structure, topology, planned_ips(topology, o.subnet, hosts=hosts))
    d_confs = dataset_confs(settings, list(structure), o.workdir)  # checks everything before writing shards
    models = usercode.check(o.workdir, structure, d_confs, path(o.structure),
                            {n: hosts.hosts[h].runtime for n, h in placement.items()})
    for node, conf in structure.items():  # (a user model's kind, inferred by the check)
        if "model" in conf:
            s_confs[node]["model"] = conf["model"]
    for line in usercode.uses(structure, models, settings):
        _say(line)
    for model in models.values():
        _say(f"model: {model['params']:,} parameters, {model['bytes'] / 1e6:.2f} MB of weights a copy")
    write_confs(o.workdir, "structure", s_confs)
    write_confs(o.workdir, "dataset", d_confs)
    timeline = None
    if o.scenario:
        from controller.model.scenario import load_scenario

        timeline = load_scenario(path(o.scenario), topology)
    telemetry = resolve(from_structure_file(path(o.structure)), o.telemetry_period_ms, not o.telemetry, o.capture)
    return RunSpec(options=o, topology=topology, structure=structure, placement=placement, host_list=hosts,
                   node_confs={n: {"structure": s_confs[n], "dataset": d_confs[n]} for n in structure},
                   dataset_settings=settings, timeline=timeline, telemetry_conf=telemetry, user_files=user_files)


def main(argv: Optional[list[str]] = None, algorithm: str = "gossip", structure_default: str = "gl_structure.json",
         dataset_default: str = "gl_dataset.json") -> int:
    """gl_run.py's flow (and fl_run.py's ...): ``argv`` parsed, then ``run``."""
    return run(parse_options(argv, algorithm, structure_default, dataset_default))


def run(options: RunOptions, experiments: Optional[list[Experiment]] = None) -> int:
    """Run what ``options`` ask for; the experiment is appended to ``experiments`` when given
    (the Testbed API reports on it). Returns the exit code.

    The experiment directory is taken first (``DirectoryLock``: another live testbed's is refused,
    that testbed named), then the testbed id (controller/workers/lock.py): in use by a live process, kept by
    ``edgetb up`` or holding nodes nobody recorded, the run stops with the holder named and
    touches nothing. What a dead holder left is removed, loudly. At the end this process removes
    only what it created itself."""
    logging.basicConfig(level=logging.WARNING)
    if os.geteuid() != 0 and not options.check:
        print("run as root (sudo): nodes are network namespaces", file=sys.stderr)
        return 2
    from controller.run.nodes import new_run_id
    from controller.workers.lock import DirectoryLock

    run_id = new_run_id()
    for sig in (signal.SIGINT, *STOP_SIGNALS):  # a kill or a closed terminal cleans up like Ctrl-C
        signal.signal(sig, _interrupt)
    directory = DirectoryLock(options.workdir)
    try:
        directory.take(options.testbed_id, port=options.port, run_id=run_id)  # another live testbed's: refused
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    try:
        return _check(options) if options.check else _main(options, experiments, run_id)
    finally:
        directory.release()


def _check(options: RunOptions) -> int:
    """``--check``: everything ``prepare`` does (every file validated, shards and confs written, the
    user's code tried in the sandbox), in the experiment directory taken as for a run; no node."""
    started = time.monotonic()
    try:
        if options.algorithm == FLOWER:
            from controller.flower.flow import check

            checked = check(options)
        else:
            spec = prepare(options)
            checked = f"{len(spec.structure)} nodes, {len(spec.topology.links)} links"
            if os.geteuid() == 0 and not options.hosts:  # this host's kernel: what it cannot shape
                from controller.workers.deploy import check_netem
                from worker.host import kernel_netem

                check_netem(spec.topology, kernel_netem())
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    _say(f"check passed in {time.monotonic() - started:.1f} s: {checked}, every file valid; nothing was made "
         "(run without --check to run it)")
    return 0


def _main(options: RunOptions, experiments: Optional[list[Experiment]], run_id: str) -> int:
    """run's flow once the experiment directory is this run's: the testbed id, then the run."""
    from controller.workers.lock import Holder, TestbedLock

    try:
        lock = TestbedLock(options.testbed_id)
        hosts_file = options.path(options.hosts) if options.hosts else None
        found = lock.take(Holder.this_process(run_id, runtime=options.runtime, subnet=options.subnet,
                                              port=options.port, hosts=hosts_file, workdir=options.workdir))
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    owned = Ownership(clean=found.state != "stale")
    try:
        return _run(options, run_id, found, owned, experiments)
    except KeyboardInterrupt as e:
        _say(f"interrupted{f' ({e})' if str(e) else ''}")
        return 130
    finally:
        _teardown(options.testbed_id, owned)
        if not owned.clean and not owned.touched and found.holder is not None:
            lock.record(found.holder)  # a dead holder's testbed left as it was: still its own
        lock.release(forget=owned.clean)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
FLOWER = "flower"  # flwr_run.py's algorithm: a Flower app's own processes in the nodes


class Ownership:
    """What this process made and still has to remove: ``worker`` is set once it creates
    (or takes over) anything; ``clean`` once nothing of the testbed is left (False from the
    start when a dead holder left it); ``touched`` once this process changed the testbed."""

    def __init__(self, clean: bool = True) -> None:
        self.worker: Any = None
        self.server: Any = None
        self.clean = clean
        self.touched = False

    def created(self, worker: Any) -> None:
        self.worker, self.clean, self.touched = worker, False, True

    def removed(self) -> None:
        self.worker, self.clean = None, True


def _run(options: RunOptions, run_id: str, found: Any, owned: Ownership,
         experiments: Optional[list[Experiment]]) -> int:
    if options.algorithm == FLOWER:  # the learning is Flower's own processes (controller/flower/flow.py)
        from controller.flower.flow import run as run_flower

        return run_flower(options, run_id, found, owned, lambda worker: remove_stale(options, found, worker, owned),
                          _say, lambda exp, worker: _serve(options, exp, worker, owned))
    try:
        spec = prepare(options)
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        if found.state == "stale":
            _say(f"{found.stale_message()}; remove what it left with: edgetb --id {options.testbed_id} down")
        return 2
    import gevent

    from controller.workers.deploy import refusal

    try:
        worker = _workers(spec)
        refused = refusal(spec.topology, worker)
        if refused is not None:
            print(f"error: {refused[1]}", file=sys.stderr)
            return refused[0]
        if found.state == "stale":
            remove_stale(options, found, worker, owned)
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    exp = Experiment(spec.topology, Nodes(options.workdir, worker, spec.structure, run_id=run_id), spec.structure,
                     controller_port=options.port, progress=_say, algorithm=options.algorithm,
                     node_confs=spec.node_confs, inputs=spec.inputs, dataset=spec.dataset_settings,
                     testbed_id=options.testbed_id, verbose=options.verbose, open_network=options.open_network,
                     telemetry_conf=spec.telemetry_conf)
    if experiments is not None:
        experiments.append(exp)
    if spec.timeline is not None:
        from controller.workers.deploy import planned_ips
        from controller.run.scenario_runner import ScenarioRunner

        try:  # what this testbed cannot apply is refused before anything is created
            exp.scenario = ScenarioRunner(spec.timeline, worker, planned_ips(spec.topology, options.subnet,
                                                                             hosts=spec.host_list),
                                          progress=_say, experiment=exp)
        except TestbedError as e:
            print(f"error: {e.message}", file=sys.stderr)
            return 2
    server = _serve(options, exp, worker, owned)
    if server is None:
        return 2
    code = 0
    port = options.port
    try:
        owned.created(worker)
        run_blocking(exp.sync_code)  # in a thread: other hosts fetch the code from this server meanwhile
        exp.deploy()
        _say(f"dashboard: http://localhost:{port}/ (live while the run goes on; stored runs too)")
        if exp.scenario is not None and spec.timeline is not None:
            exp.scenario.ips = {n.name: n.ip for n in exp.nodes.values()}
            _say(f"scenario {options.scenario}: {len(spec.timeline.steps)} steps, applied from /start")
        if options.auto:
            runner = gevent.spawn(_auto, exp, options.timeout_s)
            runner.link(lambda g: server.stop(timeout=1))
            server.serve_forever()
            code = runner.value if runner.dead and runner.value is not None else 1
        else:
            _say(f"controller on :{port}, testbed {options.testbed_id}, run {run_id}. Next: "
                 f"curl localhost:{port}/start ; curl localhost:{port}/status ; "
                 f"curl localhost:{port}/finish ; curl localhost:{port}/emulated/reset")
            server.serve_forever()
    except KeyboardInterrupt:
        exp.close("interrupted")  # the run folder first; the teardown follows
        raise
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        code = 1
    return code


def _serve(options: RunOptions, exp: Any, worker: Worker, owned: Ownership) -> Optional[Servers]:
    """The controller's servers of ``exp`` (an Experiment, or a Flower run's session:
    controller.flower.session), started, with the dashboard's live view; /emulated/reset stops
    them. None when they cannot start (said on stderr)."""
    import gevent

    hub = gevent.get_hub()
    hub.NOT_ERROR = (*hub.NOT_ERROR, KeyboardInterrupt)  # an interrupt is the main flow's to report
    server: Optional[Servers] = None

    def on_reset() -> None:
        owned.removed()
        gevent.spawn(lambda: server and server.stop(timeout=1))

    exp.live = LiveFeed(exp)
    try:
        app = create_app(exp, admin_token=admin_token_of(options, worker), on_reset=on_reset)
        server = owned.server = Servers([(a, options.port) for a in listen_addresses(options, worker)], app)
        server.start()
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return None
    except (OSError, ValueError) as e:
        print(f"error: cannot listen on port {options.port}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return None
    return server


def _cluster(worker: Worker) -> Any:
    """``worker`` when it is a cluster of hosts, else None."""
    from controller.workers.cluster import Cluster

    return worker if isinstance(worker, Cluster) else None


def admin_token_of(options: RunOptions, worker: Worker) -> Optional[str]:
    """The controller's admin token, from ``--admin-token-file`` (never an agent's token)."""
    if not options.admin_token_file:
        return None
    from worker.agent import read_token_file

    token = read_token_file(options.path(options.admin_token_file))
    cluster = _cluster(worker)
    if cluster is not None and token in cluster.tokens.values():
        raise ConfigError(f"{options.admin_token_file}: the admin token is an agent's token; give the controller "
                          "its own")
    return token


def listen_addresses(options: RunOptions, worker: Worker) -> list[str]:
    """Where the controller listens: loopback (the user's curl), the address its nodes and
    agents reach it by (the bridge's, made later by deploy; a cluster's controller_ip), and
    every ``--listen`` address; never every address of the host."""
    import ipaddress

    from controller.workers.cluster import gateway

    cluster = _cluster(worker)
    nodes_side = (cluster.controller_ip if cluster is not None else None) or gateway(options.subnet)
    found = ["127.0.0.1", *([nodes_side] if nodes_side else []), *options.listen]
    for addr in found:
        ipaddress.ip_address(addr)  # ValueError names it
    return found


def remove_stale(options: RunOptions, found: Any, worker: Worker, owned: Ownership) -> None:
    """Remove what a dead holder of the id left on this host (and on this run's other hosts)."""
    _say(f"{found.stale_message()}: removing its namespaces, links and node processes")
    owned.created(worker)
    removed = reset_stale(options.testbed_id, options.subnet, found)  # the runtime the state file records
    if options.hosts:
        worker.reset()
    elif found.holder and found.holder.details.get("hosts"):
        _say(f"it also ran nodes on the hosts of {found.holder.details['hosts']}: remove those with "
             f"'edgetb --agent URL --id {options.testbed_id} down' for each host, or run with that --hosts file")
    owned.removed()
    _say(f"removed {removed['nodes']} nodes left by the dead run; going on")


def _teardown(testbed_id: str, owned: Ownership) -> None:
    """Remove what this process created, whatever stopped it; signals wait until it is done."""
    for sig in (signal.SIGINT, *STOP_SIGNALS):
        signal.signal(sig, _during_teardown)
    if owned.server is not None:
        try:
            owned.server.stop(timeout=1)
        except Exception:  # noqa: BLE001 - the teardown goes on
            pass
    if owned.worker is None:
        return
    _say("removing the nodes and links")
    try:
        owned.worker.reset()
        owned.removed()
    except TestbedError as e:
        _say(f"error: could not remove testbed {testbed_id}: {e.message}. Remove it with: "
             f"edgetb --id {testbed_id} down")


def _during_teardown(signum: int, frame: Any) -> None:
    _say("removing the testbed; wait until it is done")


def _workers(spec: RunSpec) -> Worker:
    """This host's worker, or with a hosts file the cluster of every host's."""
    from worker.host import REPO_ROOT

    o = spec.options
    return connect(o.testbed_id, o.subnet, runtime=o.runtime, workdir=o.workdir, code_root=REPO_ROOT,
                   hosts=spec.host_list if o.hosts else None, placement=spec.placement)


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM, SIGHUP (and Ctrl-C's SIGINT, by Python's default) stop the run; the main flow
    takes the interrupt, whichever greenlet it landed in, and removes the testbed. A request (or
    the --auto runner) it landed in goes on until it yields: switched away from here, it would
    stay parked for good, holding whatever lock it held (the live view's, and the run's)."""
    interrupt = KeyboardInterrupt(signal.Signals(signum).name)
    if "gevent" in sys.modules:
        import gevent
        import greenlet

        hub = gevent.get_hub()
        current = greenlet.getcurrent()
        if current is not hub and current is not hub.parent:  # a request or the --auto runner
            hub.loop.run_callback(hub.parent.throw, interrupt)
            return
    raise interrupt


def _auto(exp: Experiment, timeout_s: float) -> int:
    """--auto: start, wait for every node to settle, collect, summarise."""
    import gevent

    run_blocking(exp.start)
    deadline = time.monotonic() + timeout_s
    while exp.phase == "running" and time.monotonic() < deadline:
        gevent.sleep(0.5)
    how = "completed"
    if exp.phase == "running":
        _say(f"the run did not finish within {timeout_s:g}s: collecting what there is")
        how = "timeout"
    summary = run_blocking(exp.finish, how)
    print(tables.format_summary(summary["nodes"]), flush=True)
    _say(f"metrics: {summary.get('metrics')}")
    _say(f"plots: {', '.join(os.path.basename(p) for p in summary.get('plots', []))}")
    for who, what in sorted(summary.get("problems", {}).items()):
        _say(f"problem: {who}: {'; '.join(what)}")
    failed = exp.nodes.unfinished()
    if failed:
        _say(f"nodes that did not finish: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise ConfigError("run gl_run.py")
