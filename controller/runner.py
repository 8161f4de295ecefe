"""What ``gl_run.py`` (and later ``fl_run.py`` ...) do: validate, make confs, deploy,
serve the controller on :3333 until reset; with ``--auto``, drive the whole run.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any, Callable, Optional

from controller import results
from controller.app import create_app
from controller.experiment import Experiment
from controller.hosts import Hosts, check_placement, load_hosts
from controller.topology import Topology, load_links, load_nodes
from worker.errors import ConfigError, TestbedError
from worker.runtime_netns import DEFAULT_SUBNET
from worker.serving import run_blocking


def _say(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def _parser(algorithm: str, structure_default: str, dataset_default: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=f"{algorithm} learning on emulated nodes of this host")
    p.add_argument("--workdir", default=os.getcwd(), help="experiment directory (default: the current one)")
    p.add_argument("--links", default="links.json")
    p.add_argument("--nodes", help="nodes file with cpu/mem limits (default: every node in links.json)")
    p.add_argument("-s", "--structure", default=structure_default)
    p.add_argument("-d", "--dataset", default=dataset_default)
    p.add_argument("--port", type=int, default=3333, help="controller port (default 3333)")
    p.add_argument("--id", default=os.environ.get("EDGETB_ID", "0"), help="testbed id (default 0)")
    p.add_argument("--subnet", default=os.environ.get("EDGETB_SUBNET", DEFAULT_SUBNET))
    p.add_argument("--runtime", choices=("netns", "docker"), default="netns",
                   help="single host: what a node is, a network namespace or a Docker container (default netns)")
    p.add_argument("--hosts", help="hosts file: run on several worker hosts (see controller/hosts.py)")
    p.add_argument("--auto", action="store_true", help="run the whole flow, print a summary, reset")
    p.add_argument("--timeout", type=float, default=900.0, help="--auto: seconds to wait for the run (default 900)")
    p.add_argument("--quiet-nodes", action="store_true", help="do not print the nodes' progress lines")
    p.add_argument("--open-network", action="store_true",
                   help="let nodes that no link joins reach each other unshaped, as EdgeTB does "
                        "(default: no link, no path)")
    return p


def prepare(args: argparse.Namespace, algorithm: str, topology: Optional[Topology] = None) -> tuple[Any, dict[str, Any]]:
    """Load and validate everything, write shards and confs; nothing is created on the network."""
    from controller.deploy import planned_ips
    from dml_tool.confs import dataset_confs, load_dataset, load_structure, structure_confs, write_confs

    path = lambda name: os.path.join(args.workdir, name)  # noqa: E731
    if topology is None:
        declared = load_nodes(path(args.nodes)) if args.nodes else None
        topology = load_links(path(args.links), declared, nodes_declared=declared is not None)
    hosts = load_hosts(path(args.hosts)) if args.hosts else Hosts.single(args.runtime, topology)
    args.placement = check_placement(topology, hosts, args.hosts or "the single-host default (use --hosts for "
                                                                    "physical nodes and other hosts)")
    args.host_list = hosts
    structure = load_structure(path(args.structure), topology, algorithm)
    settings = load_dataset(path(args.dataset))
    write_confs(args.workdir, "structure", structure_confs(structure, topology, planned_ips(topology, args.subnet)))
    write_confs(args.workdir, "dataset", dataset_confs(settings, list(structure), args.workdir))
    return topology, structure


def main(argv: Optional[list[str]] = None, algorithm: str = "gossip", structure_default: str = "gl_structure.json",
         dataset_default: str = "gl_dataset.json", topology: Optional[Topology] = None) -> int:
    """gl_run.py's flow; ``topology`` comes from the Testbed API instead of links.json when given."""
    args = _parser(algorithm, structure_default, dataset_default).parse_args(argv)
    args.workdir = os.path.realpath(args.workdir)
    logging.basicConfig(level=logging.WARNING)
    if os.geteuid() != 0:
        print("run as root (sudo): nodes are network namespaces", file=sys.stderr)
        return 2
    try:
        topology, structure = prepare(args, algorithm, topology)
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    from gevent.pywsgi import WSGIServer

    try:
        worker = _workers(args)
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        return 2
    progress: Callable[[str], None] = _say
    if args.quiet_nodes:
        progress = lambda m: None if m.split(":", 1)[0] in structure else _say(m)  # noqa: E731
    exp = Experiment(args.workdir, topology, worker, structure, controller_port=args.port, progress=progress,
                     open_network=args.open_network)
    server: Optional[WSGIServer] = None
    stop = lambda: server and server.stop(timeout=1)  # noqa: E731
    app = create_app(exp, admin_token=os.environ.get("EDGETB_TOKEN"), on_reset=lambda: __import__("gevent").spawn(stop))
    server = WSGIServer(("0.0.0.0", args.port), app, log=None)
    try:
        server.start()
    except OSError as e:
        print(f"error: cannot listen on port {args.port}: {e.strerror}", file=sys.stderr)
        return 2
    code = 0
    signal.signal(signal.SIGTERM, _interrupt)  # a kill cleans up like Ctrl-C
    try:
        run_blocking(exp.sync_code)  # in a thread: other hosts fetch the code from this server meanwhile
        exp.deploy()
        if args.auto:
            import gevent

            runner = gevent.spawn(_auto, exp, args.timeout)
            runner.link(lambda g: stop())
            server.serve_forever()
            code = runner.value if runner.dead and runner.value is not None else 1
        else:
            _say(f"controller on :{args.port}. Next: curl localhost:{args.port}/start ; "
                 f"curl localhost:{args.port}/status ; curl localhost:{args.port}/finish ; "
                 f"curl localhost:{args.port}/emulated/reset")
            server.serve_forever()
    except KeyboardInterrupt:
        _say("interrupted")
        code = 130
    except TestbedError as e:
        print(f"error: {e.message}", file=sys.stderr)
        code = 1
    finally:
        if server is not None:
            server.stop(timeout=1)
        if exp.phase != "reset":
            _say("removing the nodes and links")
            worker.reset()
    return code


def _workers(args: argparse.Namespace) -> Any:
    """This host's worker, or with a hosts file the cluster of every host's."""
    from worker.host import REPO_ROOT, WorkerHost

    if not args.hosts:
        return WorkerHost(args.id, args.subnet, runtime=args.runtime, workdir=args.workdir, code_root=REPO_ROOT)
    from controller.cluster import Cluster

    return Cluster.connect(args.host_list, args.placement, args.id, args.subnet, args.workdir, REPO_ROOT)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _auto(exp: Experiment, timeout_s: float) -> int:
    """--auto: start, wait for every node to settle, collect, summarise."""
    import gevent

    run_blocking(exp.start)
    deadline = time.monotonic() + timeout_s
    while exp.phase == "running" and time.monotonic() < deadline:
        gevent.sleep(0.5)
    if exp.phase == "running":
        _say(f"the run did not finish within {timeout_s:g}s: collecting what there is")
    summary = run_blocking(exp.finish)
    print(results.format_summary(summary["nodes"]), flush=True)
    _say(f"metrics: {summary['metrics']}")
    _say(f"plots: {', '.join(os.path.basename(p) for p in summary['plots'])}")
    failed = [n["node"] for n in summary["nodes"] if n["ended"] != "done"]
    if failed:
        _say(f"nodes that did not finish: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise ConfigError("run gl_run.py")
