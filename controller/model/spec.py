"""What a run is, typed: ``RunOptions`` (what the user asked for) and ``RunSpec`` (resolved).

``RunOptions`` come from a run script's command line (``controller.runner.parse_options``:
``gl_run.py --auto ...``) or from the Testbed API (``controller.testbed``), which also gives
the topology it declared. ``controller.runner.prepare`` reads and validates the files they
name and makes the ``RunSpec``: the topology, where each node runs, the nodes' confs, the
scenario's timeline and the telemetry settings. ``controller.runner.run`` runs it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional

from controller.model.hosts import Hosts
from controller.model.scenario import Timeline
from controller.model.telemetry_conf import TelemetryConf
from controller.model.topology import Topology
from controller.model.traces import trace_inputs
from worker.api.protocol import DEFAULT_SUBNET

INPUT_ROLES = ("links", "nodes", "structure", "dataset", "hosts", "scenario")  # the files a run reads


@dataclass(frozen=True)
class RunOptions:
    """A run as asked for; file names are relative to ``workdir`` (an absolute one stays)."""

    algorithm: str = "gossip"
    workdir: str = "."
    links: str = "links.json"
    nodes: Optional[str] = None  # nodes file with cpu/mem limits (default: every node in links.json)
    structure: str = "gl_structure.json"
    dataset: str = "gl_dataset.json"
    port: int = 3333  # the controller's
    admin_token_file: Optional[str] = None
    listen: tuple[str, ...] = ()  # more addresses the controller serves on
    testbed_id: str = "0"
    subnet: str = DEFAULT_SUBNET
    runtime: str = "netns"  # single host: netns or docker
    hosts: Optional[str] = None  # hosts file: several worker hosts
    auto: bool = False  # run the whole flow, print a summary, reset
    check: bool = False  # validate every file and try the user's code; make nothing
    timeout_s: float = 900.0  # auto: the longest wait for the run
    verbose: bool = False
    scenario: Optional[str] = None
    open_network: bool = False
    telemetry_period_ms: Optional[int] = None  # None: the structure file's, else the default
    telemetry: bool = True
    capture: Optional[str] = None  # "n1,n2" or "all"; None: the structure file's
    topology: Optional[Topology] = field(default=None, compare=False)  # declared by the API, not in links.json

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    @property
    def inputs(self) -> dict[str, str]:
        """The files this run reads, by role (links, nodes, structure, ...), as paths."""
        return {role: self.path(getattr(self, role)) for role in INPUT_ROLES if getattr(self, role)}


USER_INPUT = "user:"  # the role of a user's code file among a run's inputs


@dataclass(frozen=True)
class RunSpec:
    """A run resolved and validated: nothing is left to read or decide before it starts."""

    options: RunOptions
    topology: Topology
    structure: dict[str, dict[str, Any]]  # node -> its role's settings
    placement: dict[str, str]  # node -> host
    host_list: Hosts
    node_confs: dict[str, dict[str, Any]]  # node -> {"structure", "dataset"}
    dataset_settings: Any
    timeline: Optional[Timeline]
    telemetry_conf: TelemetryConf
    user_files: dict[str, str] = field(default_factory=dict)  # the user's code: relative path -> file

    @property
    def inputs(self) -> dict[str, str]:
        """The files this run reads (``RunOptions.inputs``), the recordings its links and scenario
        replay and the user's code, these two as ``user:<path>``."""
        replays = [*self.topology.traces.values(), *self.topology.access_traces.values(),
                   *(self.timeline.replays if self.timeline else [])]
        return {**self.options.inputs, **trace_inputs(replays, self.options.workdir),
                **{f"{USER_INPUT}{rel}": p for rel, p in self.user_files.items()}}
