"""What a run records besides the nodes' events: the hosts' telemetry, packet captures, a live view.

Both start before any role starts and end before the run's results are written: the telemetry
collector (``controller.telemetry.collector``) pulls every host's sampler into ``telemetry/``
of the run folder; each capture asked for is copied into ``telemetry/pcap/<node>.pcap``. Neither
stops the run when it cannot be had: the problem is recorded instead. A live view of the run
(``RunWatcher``, e.g. ``controller.web.live.LiveFeed``) is told of each round and samples the run.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Protocol

from controller.model.telemetry_conf import TelemetryConf
from controller.results.rates import LinkRates
from controller.results.run_dir import PCAP_DIR, RunDir
from controller.telemetry.collector import Collector
from controller.workers.api import Worker
from worker.api.errors import ConfigError, TestbedError

log = logging.getLogger("edgetb.controller")


def capture_list(capture: Optional[list[str] | str], nodes: list[str],
                 conf: Optional[TelemetryConf] = None) -> list[str]:
    """The nodes to capture: none, ``"all"``, or names of this run's nodes (an unknown one is refused);
    when ``capture`` is None, those of ``conf`` (none without it)."""
    if capture is None and conf is not None:
        return conf.capture_nodes(list(nodes))
    if not capture:
        return []
    if capture == "all":
        return list(nodes)
    if isinstance(capture, str) or not isinstance(capture, list) or not all(isinstance(n, str) for n in capture):
        raise ConfigError(f"capture must be \"all\" or a list of node names, not {capture!r}")
    unknown = [n for n in capture if n not in nodes]
    if unknown:
        raise ConfigError(f"capture: no node {', '.join(repr(n) for n in unknown)} in this run")
    return list(dict.fromkeys(capture))


class RunWatcher(Protocol):
    """What the experiment tells a live view of the run (``controller.web.live.LiveFeed``)."""

    def report(self, name: str, round_no: int, accuracy: Optional[float], loss: Optional[float],
               layer: Optional[int]) -> None: ...

    def sample(self) -> None: ...


class NoWatcher:
    """No live view: what it is told is dropped."""

    def report(self, name: str, round_no: int, accuracy: Optional[float], loss: Optional[float],
               layer: Optional[int]) -> None:
        pass

    def sample(self) -> None:
        pass


class Recording:
    """The telemetry (``conf``) and the captures (of the nodes ``capture``) of one run on ``worker``."""

    def __init__(self, worker: Worker, conf: TelemetryConf, capture: list[str],
                 progress: Callable[[str], None] = print) -> None:
        self.worker = worker
        self.conf = conf
        self.capture = capture
        self.progress = progress
        self.capturing: list[str] = []  # the nodes whose capture was started
        self.telemetry: Optional[Collector] = None  # pulls the hosts' samplers while the run goes on

    def start_captures(self) -> None:
        """Start the captures asked for (before any role starts)."""
        if not self.capture:
            return
        self.progress(f"capturing the egress of {len(self.capture)} nodes")
        for name in self.capture:
            self.worker.start_capture(name, {"version": 1})
            self.capturing.append(name)

    def start_telemetry(self, out: RunDir, rates: LinkRates) -> Optional[dict[str, Any]]:
        """Start every host's sampler; when a host cannot, the run goes on without telemetry and
        the returned problem is run.json's ``telemetry`` (None when it started, or is off)."""
        if not self.conf.enabled:
            return None
        collector = Collector(self.worker, self.conf, out, rates)
        try:
            collector.start()
        except (TestbedError, OSError) as e:
            collector.abandon()
            message = e.message if isinstance(e, TestbedError) else str(e)
            self.progress(f"telemetry not sampled: {message}")
            return {**self.conf.to_dict(), "problem": message}
        self.telemetry = collector
        return None

    def run_from(self, t0: float) -> None:
        """The run's start at monotonic ``t0``: the telemetry's time zero, then it pulls in its own thread."""
        if self.telemetry is not None:
            self.telemetry.mark_start(t0)
            self.telemetry.run_in_thread()

    def finish_telemetry(self) -> Optional[dict[str, Any]]:
        """The last pull, the samplers stopped, the CSV files closed; the summary for run.json
        (None when nothing was sampled)."""
        if self.telemetry is None:
            return None
        try:
            summary = self.telemetry.finish()
        except Exception as e:  # noqa: BLE001 - the run's own results come first
            log.exception("telemetry could not be finished")
            summary = {"problem": str(e)}
        return {**self.conf.to_dict(), **summary}

    def collect_captures(self, out: RunDir) -> dict[str, Any]:
        """Stop every capture, copy its file into ``telemetry/pcap/<node>.pcap`` and remove the
        worker's; a capture that cannot be had is recorded, never fatal to the run's other files."""
        found: dict[str, Any] = {}
        for name in list(self.capturing):
            try:
                stopped = self.worker.stop_capture(name)
                out.write_chunks(f"{PCAP_DIR}/{name}.pcap", self.worker.capture_chunks(name))
                found[name] = {"bytes": stopped.get("bytes"), "kernel_drops": stopped.get("kernel_drops")}
                self.worker.remove_capture(name)  # the run folder has it now
            except Exception as e:  # noqa: BLE001 - one capture never stops the others
                found[name] = {"error": e.message if isinstance(e, TestbedError) else f"{type(e).__name__}: {e}"}
            self.capturing.remove(name)
        return found
