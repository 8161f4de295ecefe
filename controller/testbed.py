"""The Testbed API, in the spirit of EdgeTB's, for experiments written as Python scripts::

    tb = Testbed(workdir=".", structure="gl_structure.json", dataset="gl_dataset.json")
    tb.add_emulator("local")
    tb.add_emulated_node("n1", cpu=0.5, mem="256M")
    tb.add_emulated_node("n2")
    tb.load_link("links.json")
    run = tb.start()    # validate, write confs, deploy, controller on :3333 until reset
    run = tb.start(auto=True)  # or: run to completion; run.nodes, run.metrics(), run.dataframe()
    tb.sweep("sweep.json")     # or: a series of runs (controller/sweep.py); the links come from it

Emulators on other hosts and physical devices run an agent each
(``python3 -m worker.agent``); ``add_emulator("e1", agent="http://10.0.0.2:3334")``
and ``add_physical_node("pi1", ip="10.0.0.9", agent="http://10.0.0.9:3334")``
declare them, and ``start()`` writes the hosts file (controller/model/hosts.py) for them.
"""
from __future__ import annotations

import csv
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from controller.bootstrap import use_venv

use_venv(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), sys.argv[0] or "the Testbed API")

from controller.model.topology import Topology, device_access_rates, device_contention, load_links  # noqa: E402
from worker.api.errors import ConfigError  # noqa: E402
from worker.api.protocol import DEFAULT_SUBNET  # noqa: E402


@dataclass
class Run:
    """What ``Testbed.start`` hands back: the run's identity, how it ended, its per-node summary."""

    run_id: str
    run_dir: str
    phase: str
    exit_code: int
    ended: Optional[str] = None
    nodes: list[dict[str, Any]] = field(default_factory=list)

    def metrics(self) -> list[dict[str, str]]:
        """metrics.csv as rows (empty when the run wrote none)."""
        path = os.path.join(self.run_dir, "metrics.csv")
        if not os.path.exists(path):
            return []
        with open(path, newline="") as f:
            return list(csv.DictReader(f))

    def dataframe(self) -> Any:
        """metrics.csv as a pandas DataFrame (needs pandas)."""
        try:
            import pandas
        except ImportError:
            raise ConfigError("Run.dataframe() needs pandas: pip install pandas (or use Run.metrics())") from None
        return pandas.read_csv(os.path.join(self.run_dir, "metrics.csv"))


class Testbed:
    """Declare emulators, nodes and links; ``start()`` runs the experiment like gl_run.py."""

    __test__ = False

    def __init__(self, workdir: str = ".", structure: str = "gl_structure.json", dataset: str = "gl_dataset.json",
                 port: int = 3333, testbed_id: str = "0", subnet: str = DEFAULT_SUBNET, algorithm: str = "gossip",
                 open_network: bool = False, telemetry_period_ms: Optional[int] = None, telemetry: bool = True,
                 capture: Union[str, list[str], None] = None) -> None:
        """``open_network=True``: nodes that no link joins reach each other (EdgeTB's network);
        by default they cannot (no link, no path). ``telemetry_period_ms``, ``telemetry=False`` and
        ``capture`` (node names or "all") override the structure file's "telemetry" settings."""
        from controller.model.telemetry_conf import TelemetryConf, resolve

        resolve(TelemetryConf(), telemetry_period_ms, not telemetry, capture)  # bad values refused here
        self.telemetry_args = (telemetry_period_ms, telemetry, capture)
        self.workdir = os.path.realpath(workdir)
        self.open_network = open_network
        self.structure, self.dataset, self.port = structure, dataset, port
        self.testbed_id, self.subnet, self.algorithm = testbed_id, subnet, algorithm
        self.topology = Topology()
        self.emulators: dict[str, dict[str, Any]] = {}
        self._links_loaded = False
        self._trace_files: Any = None
        self.scenario: Optional[str] = None

    def add_emulator(self, name: str, agent: Optional[str] = None, runtime: str = "netns", ip: Optional[str] = None,
                     nfs: Optional[str] = None, token_file: Optional[str] = None,
                     tls_fingerprint: Optional[str] = None) -> None:
        """An emulator host: this machine (no ``agent``) or the agent at ``agent`` (``https://IP:PORT``,
        its certificate's ``tls_fingerprint`` pinned); ``runtime`` is netns or docker; the other
        fields are those of hosts.json (controller/model/hosts.py)."""
        if name in self.emulators:
            raise ConfigError(f"emulator {name!r} declared twice")
        if runtime not in ("netns", "docker"):
            raise ConfigError(f"emulator {name!r}: runtime must be netns or docker, not {runtime!r}")
        entry = {"name": name, "runtime": runtime, "agent": agent, "ip": ip, "nfs": nfs, "token_file": token_file,
                 "tls_fingerprint": tls_fingerprint}
        self.emulators[name] = {k: v for k, v in entry.items() if v is not None}

    def add_emulated_node(self, name: str, cpu: Optional[float] = None, mem: Union[str, int, None] = None,
                          emulator: Optional[str] = None, uplink: Union[str, int, None] = None,
                          downlink: Union[str, int, None] = None, pids: Optional[int] = None,
                          python: Optional[str] = None, device: Optional[str] = None) -> None:
        """An emulated node; ``uplink``/``downlink`` are its access links (e.g. '10mbit'), shared by all its peers;
        ``pids`` its processes and threads at most (default: the worker's); ``python`` a virtual
        environment on its host, first on its PATH (nodes.json's ``"python"``); ``device`` a
        built-in device class (nodes.json's ``"device"``): the CPU quota and memory follow from it."""
        host = emulator or next(iter(self.emulators), "local")
        if self.emulators and host not in self.emulators:
            raise ConfigError(f"node {name!r}: unknown emulator {host!r}")
        record = None
        if device is not None:
            from controller.calibration import host_kernel_s
            from controller.model import devices

            if cpu is not None:
                raise ConfigError(f"node {name!r}: the CPU quota follows from the device class {device!r}; give cpu "
                                  f"or device, not both")
            record = devices.node_device(devices.device_class(devices.BUILTIN, device, f"Testbed: node {name!r}"),
                                         host_kernel_s())
            cpu, mem = record["quota_cores"], mem if mem is not None else record["mem_bytes"]
            uplink, downlink, record = device_access_rates(uplink, downlink, record, {}, f"Testbed: node {name!r}")
        self.topology.add_node(name, "emulated", host, cpu, mem, source="Testbed", uplink=uplink, downlink=downlink,
                               pids=pids, python=python, device=record)
        if record is not None:
            device_contention(self.topology, "Testbed")

    def add_physical_node(self, name: str, ip: str, agent: str, token_file: Optional[str] = None,
                          tls_fingerprint: Optional[str] = None, uplink: Union[str, int, None] = None) -> None:
        """A device at ``ip`` running its own agent (``https://IP:PORT``, its certificate's
        ``tls_fingerprint`` pinned); it is a host of its own."""
        if name in self.emulators:
            raise ConfigError(f"physical node {name!r}: a host of that name is declared already")
        self.topology.add_node(name, "physical", name, ip=ip, source="Testbed", uplink=uplink)
        entry = {"name": name, "runtime": "physical", "agent": agent, "token_file": token_file,
                 "tls_fingerprint": tls_fingerprint}
        self.emulators[name] = {k: v for k, v in entry.items() if v is not None}

    def load_link(self, path: str = "links.json") -> None:
        """Add the links of ``path`` between the declared nodes (every node must be declared)."""
        if self._links_loaded:
            raise ConfigError("links are already loaded")
        load_links(os.path.join(self.workdir, path), self.topology, nodes_declared=True)
        self._links_loaded = True

    def add_link(self, src: str, dst: str, bw: Union[str, int, None] = None, delay: Optional[str] = None,
                 jitter: Optional[str] = None, loss: Union[str, float, None] = None, queue: Optional[int] = None,
                 trace: Optional[dict[str, Any]] = None) -> None:
        """The directed link ``src -> dst`` between declared nodes, with links.json's fields: a
        constant ``bw`` ('10mbit', or bit/s) or a ``trace`` to replay (links.json's trace object,
        its file relative to the workdir: ``{"file": "traces/bus.down", "format": "mahimahi"}``)."""
        from controller.model.topology import links_from_data
        from controller.model.traces import TraceFiles

        entry = {"dest": dst, "bw": f"{bw}bit" if isinstance(bw, int) and not isinstance(bw, bool) else bw,
                 "delay": delay, "jitter": jitter, "loss": loss, "queue": queue, "trace": trace}
        if self._trace_files is None:
            self._trace_files = TraceFiles(self.workdir)  # (each recording read once, however many links)
        links_from_data({src: [{k: v for k, v in entry.items() if v is not None}]}, f"Testbed: add_link({src!r}, "
                        f"{dst!r})", self.topology, nodes_declared=True, traces=self._trace_files)

    def _need_links(self, before: str) -> None:
        if not self._links_loaded and not self.topology.links:
            raise ConfigError(f"call load_link() or add_link() before {before}")

    def load_scenario(self, path: str = "scenario.json") -> list[str]:
        """Apply the scenario of ``path`` (beside links.json) during the run; it is checked now
        against the declared nodes and links, and its timeline returned as lines (as ``--dry-run``)."""
        from controller.model.scenario import load_scenario

        self._need_links("load_scenario()")
        timeline = load_scenario(os.path.join(self.workdir, path), self.topology)
        self.scenario = path
        return timeline.render()

    def predict(self, model: str = "model.json") -> dict[str, Any]:
        """Predict round time, traffic and bursts of this experiment without running it, with a
        model file from ``edgetb predict fit`` (relative to the workdir); the same document as
        ``edgetb predict INPUT_DIR`` writes in prediction.json (controller/predict/)."""
        from controller.predict import model_file
        from controller.predict.setting import from_files

        self._need_links("predict()")
        setting = from_files(os.path.join(self.workdir, self.structure), os.path.join(self.workdir, self.dataset),
                             self.topology, self.algorithm, self.workdir,
                             os.path.join(self.workdir, self.scenario) if self.scenario else None)
        return model_file.predict_rows(model_file.load(os.path.join(self.workdir, model)),
                                       model_file.rows_of_setting(setting))

    def sweep(self, path: str = "sweep.json", retry_failed: bool = False, check_only: bool = False) -> Any:
        """Run the sweep file ``path`` (relative to the workdir; docs/how-to/sweeps.md) as
        ``edgetb sweep`` does: every run one after another, its folder resumed when run again.
        Returns the ``controller.sweep.Outcome`` (its ``summary``: the table's account), or with
        ``check_only`` the checked ``controller.model.sweep.Sweep`` (its ``runs``), running nothing."""
        from controller import sweep

        file = os.path.join(self.workdir, path)
        if check_only:
            found = sweep.load_sweep(file, self.workdir)
            sweep.check(found)
            return found
        return sweep.run_sweep(file, self.workdir, retry_failed=retry_failed)

    def start(self, auto: bool = False) -> Run:
        """Validate, make confs, deploy and serve on the port until reset (``auto``: run to
        completion); returns the ``Run``."""
        from controller.model.spec import RunOptions
        from controller.runner import run

        self._need_links("start()")
        period_ms, telemetry, capture = self.telemetry_args
        hosts: Optional[str] = None
        if any("agent" in host for host in self.emulators.values()):
            hosts = os.path.join(self.workdir, "dml_file", "hosts.json")
            os.makedirs(os.path.dirname(hosts), exist_ok=True)
            with open(hosts, "w") as f:
                json.dump({"version": 1, "hosts": list(self.emulators.values())}, f, indent=1)
        docker = hosts is None and any(host["runtime"] == "docker" for host in self.emulators.values())
        options = RunOptions(algorithm=self.algorithm, workdir=self.workdir, structure=self.structure,
                             dataset=self.dataset, port=self.port, testbed_id=self.testbed_id, subnet=self.subnet,
                             runtime="docker" if docker else "netns", hosts=hosts, auto=auto,
                             scenario=self.scenario, open_network=self.open_network,
                             telemetry_period_ms=period_ms, telemetry=telemetry,
                             capture=(capture if isinstance(capture, str) else ",".join(capture)) if capture else None,
                             topology=self.topology)
        made: list[Any] = []
        code = run(options, experiments=made)
        if not made:
            raise ConfigError(f"the experiment did not start (exit code {code}): see the messages above")
        exp = made[0]
        return Run(exp.run_id, exp.run_dir, exp.phase, code, exp.ended or None, list((exp.summary or {}).get("nodes", [])))
