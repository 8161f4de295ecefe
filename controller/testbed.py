"""The Testbed API, in the spirit of EdgeTB's, for experiments written as Python scripts::

    tb = Testbed(workdir=".", structure="gl_structure.json", dataset="gl_dataset.json")
    tb.add_emulator("local")
    tb.add_emulated_node("n1", cpu=0.5, mem="256M")
    tb.add_emulated_node("n2")
    tb.load_link("links.json")
    tb.start()          # validate, write confs, deploy, controller on :3333 until reset

Single-host emulators only for now; physical nodes are declared and refused at
deploy with a clear message (multi-host comes with the hybrid milestone).
"""
from __future__ import annotations

import os
from typing import Any, Optional, Union

from controller.topology import Topology, load_links
from worker.errors import ConfigError
from worker.runtime_netns import DEFAULT_SUBNET


class Testbed:
    """Declare emulators, nodes and links; ``start()`` runs the experiment like gl_run.py."""

    __test__ = False

    def __init__(self, workdir: str = ".", structure: str = "gl_structure.json", dataset: str = "gl_dataset.json",
                 port: int = 3333, testbed_id: str = "0", subnet: str = DEFAULT_SUBNET, algorithm: str = "gossip") -> None:
        self.workdir = os.path.realpath(workdir)
        self.structure, self.dataset, self.port = structure, dataset, port
        self.testbed_id, self.subnet, self.algorithm = testbed_id, subnet, algorithm
        self.topology = Topology()
        self.emulators: dict[str, dict[str, Any]] = {}
        self._links_loaded = False

    def add_emulator(self, name: str, ip: Optional[str] = None) -> None:
        if name in self.emulators:
            raise ConfigError(f"emulator {name!r} declared twice")
        if ip is not None or self.emulators:
            raise ConfigError("only one local emulator is supported so far (multi-host comes later)")
        self.emulators[name] = {"ip": ip}

    def add_emulated_node(self, name: str, cpu: Optional[float] = None, mem: Union[str, int, None] = None,
                          emulator: Optional[str] = None) -> None:
        host = emulator or next(iter(self.emulators), "local")
        if self.emulators and host not in self.emulators:
            raise ConfigError(f"node {name!r}: unknown emulator {host!r}")
        self.topology.add_node(name, "emulated", host, cpu, mem, source="Testbed")

    def add_physical_node(self, name: str, ip: str) -> None:
        self.topology.add_node(name, "physical", "local", ip=ip, source="Testbed")

    def load_link(self, path: str = "links.json") -> None:
        """Add the links of ``path`` between the declared nodes (every node must be declared)."""
        if self._links_loaded:
            raise ConfigError("links are already loaded")
        load_links(os.path.join(self.workdir, path), self.topology, nodes_declared=True)
        self._links_loaded = True

    def start(self, auto: bool = False) -> int:
        """Validate, make confs, deploy and serve on the port until reset (``auto``: run to completion)."""
        from controller.runner import main

        if not self._links_loaded:
            raise ConfigError("call load_link() before start()")
        argv = ["--workdir", self.workdir, "-s", self.structure, "-d", self.dataset, "--port", str(self.port),
                "--id", self.testbed_id, "--subnet", self.subnet] + (["--auto"] if auto else [])
        return main(argv, algorithm=self.algorithm, topology=self.topology)
