"""The Flower processes of a run, as data: each node's programs (argv and environment), the
SuperLink's address and Flower's CLI config. Pure: unit-tested without root or Flower.

The SuperLink serves its Fleet, Control and Runtime APIs on one port of its node's address;
each SuperNode runs with ``--isolation process`` beside one ``flower-superexec`` that starts its
ClientApp processes (flwr 1.42: one for each message, which ends with its reply); on a netns host
all of them are forked from one process that imported flwr (``FORKED_ENV``); every Flower
home (``FLWR_HOME``, one a run) lies in the node's own directory, the one place a node writes.
The SuperLink keeps its state in an SQLite file there up to ``FILE_STATE_MAX_SUPERNODES``
SuperNodes, and in memory (Flower's own default) above: flwr waits at most 5 s for the file's
lock (its fixed ``busy_timeout``), and the writes of 50 SuperNodes' heartbeats and pulls on two
loaded cores waited longer ("database is locked", the run's task expired in round 1).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from controller.flower.structure import FlowerStructure, app_dependencies
from worker.api.errors import ConfigError
from worker.api.protocol import FLOWER_PRELOADS, PRELOAD_ENV

SUPERLINK_PORT = 9092
CLIENTAPP_PORT = 9094  # a SuperNode's Runtime API, on its node's loopback
CONNECTION = "edgetb"  # the SuperLink's name in Flower's CLI config
HOME_PREFIX = "flwr_home-"  # + the run id: a run's own (a node's uid is another in another testbed)
DATABASE = "superlink.db"
FILE_STATE_MAX_SUPERNODES = 16  # above: the SuperLink's state in memory (no round times from its log pieces)
IN_MEMORY = ":flwr-in-memory:"  # flwr's name for its in-memory state (the default of --database)
# Every Flower process: no telemetry. flwr sends an event to its telemetry server on start and on
# exit, and its exit waits up to 4 s for that (nodes reach no internet): each stop took its 5 s grace.
FLOWER_ENV = {"FLWR_TELEMETRY_ENABLED": "0"}
# The servers, forked on a netns host from the Flower fork server of the node's Python
# (``worker.confinement.flower_forks``: flwr imported once; their ClientApps forked too)
FORKED_ENV = {"EDGETB_FORK": "flower"}
# The SuperLink's node weighs this much in the kernel's CPU sharing (cgroup cpu.weight; 100 for
# every other node): on a host loaded past its cores it still answers flwr's 5 s heartbeats.
CPU_WEIGHT_ENV = "EDGETB_CPU_WEIGHT"
SUPERLINK_CPU_WEIGHT = 800
SUPERLINK_CPU_WEIGHT_ENV = "EDGETB_FLWR_SUPERLINK_CPU_WEIGHT"  # (in the run script's environment)


def superlink_cpu_weight(environ: Any = os.environ) -> int:
    """The SuperLink node's CPU weight: ``SUPERLINK_CPU_WEIGHT_ENV`` when set (cgroup v2's scale,
    1 to 10000), else ``SUPERLINK_CPU_WEIGHT``; ConfigError naming the variable otherwise."""
    text = environ.get(SUPERLINK_CPU_WEIGHT_ENV, "")
    if not text:
        return SUPERLINK_CPU_WEIGHT
    if not text.strip().isdigit() or not 1 <= int(text) <= 10_000:
        raise ConfigError(f"{SUPERLINK_CPU_WEIGHT_ENV}={text!r}: a CPU weight is a whole number from 1 to 10000")
    return int(text)


def forked_env(structure: FlowerStructure) -> dict[str, str]:
    """``FORKED_ENV``, and what the fork server is to preload of the app's declared dependencies
    (torch: imported once there, not by every ClientApp)."""
    from packaging.requirements import InvalidRequirement, Requirement
    from packaging.utils import canonicalize_name

    try:
        declared = app_dependencies(structure.app)
    except (OSError, ValueError):  # (read and checked with the structure: nothing to preload otherwise)
        declared = []
    names = set()
    for text in declared:
        try:
            names.add(canonicalize_name(Requirement(text).name))
        except InvalidRequirement:
            continue
    preload = [p for p in FLOWER_PRELOADS if p in names]
    return {**FORKED_ENV, **({PRELOAD_ENV: ",".join(preload)} if preload else {})}


def database(structure: FlowerStructure, workdir: str, run_id: str) -> Optional[str]:
    """The SuperLink's SQLite file, or None when it keeps its state in memory."""
    if len(structure.supernodes) > FILE_STATE_MAX_SUPERNODES:
        return None
    return os.path.join(flwr_home(workdir, structure.superlink, run_id), DATABASE)


@dataclass(frozen=True)
class Program:
    """One process to start in ``node``."""

    node: str
    name: str  # superlink, supernode, superexec, run
    argv: tuple[str, ...]
    env: dict[str, str]


def node_dir(workdir: str, node: str) -> str:
    """A node's own directory (``worker.confinement.uids.node_dir``)."""
    return os.path.join(workdir, "dml_file", "node", node)


def flwr_home(workdir: str, node: str, run_id: str) -> str:
    """The node's Flower home for run ``run_id``, in its own directory."""
    return os.path.join(node_dir(workdir, node), HOME_PREFIX + run_id)


def toml_value(value: Any) -> str:
    """A scalar as TOML writes it (a string as a basic string; JSON's escapes are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value), ensure_ascii=True)


def config_pairs(config: dict[str, Any]) -> str:
    """A config table as Flower's ``--node-config``/``--run-config`` take it: ``k=v k2=v2``."""
    return " ".join(f"{k}={toml_value(v)}" for k, v in sorted(config.items()))


def node_configs(structure: FlowerStructure, shards: Optional[dict[str, str]] = None) -> dict[str, dict[str, Any]]:
    """Each SuperNode's node config: ``partition-id`` and ``num-partitions`` from its place in
    node_list, ``data-path`` (its shard, absolute) when a dataset is given, then its own entries."""
    configs = {}
    for i, node in enumerate(structure.supernodes):
        conf: dict[str, Any] = {"partition-id": i, "num-partitions": len(structure.supernodes)}
        if shards and node in shards:
            conf["data-path"] = shards[node]
        conf.update(structure.node_config.get(node, {}))
        configs[node] = conf
    return configs


def cli_config(superlink_ip: str) -> str:
    """Flower's CLI config (``FLWR_HOME/config.toml``): the SuperLink, insecure inside the
    emulated network."""
    return (f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{superlink_ip}:{SUPERLINK_PORT}"\ninsecure = true\n')


def servers(structure: FlowerStructure, workdir: str, run_id: str, ips: dict[str, str],
            shards: Optional[dict[str, str]] = None, superlink_cpu_weight: int = SUPERLINK_CPU_WEIGHT) -> list[Program]:
    """The SuperLink (its node weighing ``superlink_cpu_weight``), then each SuperNode and its SuperExec."""
    sl = structure.superlink
    home = flwr_home(workdir, sl, run_id)
    weight = {CPU_WEIGHT_ENV: str(superlink_cpu_weight)} if superlink_cpu_weight != 100 else {}
    forked = forked_env(structure)
    programs = [Program(sl, "superlink", (
        "flower-superlink", "--insecure", "--disable-runtime-dependency-installation",
        "--database", database(structure, workdir, run_id) or IN_MEMORY, "--host", ips[sl], "--port", str(SUPERLINK_PORT)),
        {**FLOWER_ENV, **forked, **weight, "FLWR_HOME": home})]
    for node, conf in node_configs(structure, shards).items():
        env = {**FLOWER_ENV, **forked, "FLWR_HOME": flwr_home(workdir, node, run_id)}
        programs.append(Program(node, "supernode", (
            "flower-supernode", "--insecure", "--superlink", f"{ips[sl]}:{SUPERLINK_PORT}", "--isolation", "process",
            "--host", "127.0.0.1", "--port", str(CLIENTAPP_PORT), "--node-config", config_pairs(conf)), env))
        programs.append(Program(node, "superexec", (
            "flower-superexec", "--insecure", "--runtime-api-address", f"127.0.0.1:{CLIENTAPP_PORT}"), env))
    return programs


def submit(structure: FlowerStructure, workdir: str, run_id: str) -> Program:
    """``flwr run`` of the app in the SuperLink's node, streaming the run's log until it ends."""
    argv = ["flwr", "run", structure.app, CONNECTION, "--stream"]
    if structure.run_config:
        argv += ["--run-config", config_pairs(structure.run_config)]
    env = {**FLOWER_ENV, "FLWR_HOME": flwr_home(workdir, structure.superlink, run_id), "PYTHONUNBUFFERED": "1"}  # lines as they come
    return Program(structure.superlink, "run", tuple(argv), env)
