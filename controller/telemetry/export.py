"""What the telemetry shows outside the run folder: the configured rates a testbed's hosts
report, the text table of ``edgetb monitor`` and the Prometheus exposition of ``/metrics``."""
from __future__ import annotations

from typing import Any, Optional

from controller.results.adaptation import monitor_fields
from controller.telemetry.collector import Collector
from controller.workers.api import Worker
from controller.workers.connect import recorded_plans


def configured_rates(worker: Worker) -> dict[tuple[str, str], int]:
    """Every shaped link's rate in bit/s, (src, dst) -> rate, from the hosts' plans."""
    rates: dict[tuple[str, str], int] = {}
    for src, plan in recorded_plans(worker).items():
        for rule in (plan or {}).get("rules", []):
            rates[(src, rule["dest"])] = int(rule["shape"]["rate_bps"])
    return rates


def _compact(value: Optional[float], unit: str) -> str:
    """A quantity for a narrow column: one decimal and an SI prefix, '12.5Mb/s', '3.0GB'."""
    if value is None:
        return "-"
    for factor, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.1f}{prefix}{unit}"
    return f"{value:.0f}{unit}"


def render_table(collector: Collector, top: int = 10) -> str:
    """The live view of ``edgetb monitor``: every node's CPU, memory and traffic rates, and the
    ``top`` busiest links with their use of the configured rate and their drops."""
    lines = [f"{'node':<16} {'cpu':>7} {'mem':>9} {'tx':>10} {'rx':>10} {'drops':>7}"]
    for name in sorted(collector.latest_nodes):
        n = collector.latest_nodes[name]
        cpu = n.get("cpu_ns_per_s")
        lines.append(f"{name[:16]:<16} {'-' if cpu is None else f'{cpu / 1e7:.1f}%':>7} "
                     f"{_compact(n.get('mem_bytes'), 'B'):>9} {_compact(_bits(n.get('tx_bytes_per_s')), 'b/s'):>10} "
                     f"{_compact(_bits(n.get('rx_bytes_per_s')), 'b/s'):>10} {n.get('drops') or 0:>7}")
    busy = sorted(collector.latest_links.items(), key=lambda kv: -(kv[1].get("tx_bytes_per_s") or 0))[:top]
    if busy:
        lines += ["", f"{'link':<24} {'throughput':>11} {'of rate':>8} {'drops':>7} {'backlog':>9}"]
    for (src, dst), entry in busy:
        rate = collector.rates.now((src, dst))
        bps = _bits(entry.get("tx_bytes_per_s"))
        share = f"{100 * bps / rate:.0f}%" if rate and bps is not None else "-"
        lines.append(f"{(src + '->' + dst)[:24]:<24} {_compact(bps, 'b/s'):>11} {share:>8} "
                     f"{entry.get('drops') or 0:>7} {_compact(entry.get('backlog_bytes'), 'B'):>9}")
    for name, h in sorted(collector.latest_hosts.items()):
        cpu = h.get("cpu_ns_per_s")
        lines.append(f"host {name}: cpu {'-' if cpu is None else f'{cpu / 1e7:.0f}%'} (100% = one core), "
                     f"mem {_compact(h.get('mem_bytes'), 'B')}")
    return "\n".join(lines)


def _bits(bytes_per_s: Optional[float]) -> Optional[float]:
    return None if bytes_per_s is None else bytes_per_s * 8


MONITOR_GAUGES = {  # a node's monitor -> (gauge, help)
    "comm_goodput_bps": ("edgetb_node_comm_goodput_bps",
                         "Goodput of the node's last collective: payload bits over first chunk sent to last received"),
    "cluster_size": ("edgetb_node_cluster_size", "Members of the node's cluster in its last round"),
    "batch_size": ("edgetb_node_batch_size", "The node's batch size in its last round"),
    "gns": ("edgetb_node_gns", "Gradient noise scale the node estimated in its last round"),
    "grad_var": ("edgetb_node_grad_var", "Gradient variance the node measured in its last round"),
}


def live_energy_j(latest: dict[str, Any], device: dict[str, Any]) -> Optional[float]:
    """A device node's modelled energy since the run's start from its newest cumulative counters
    (``controller.results.energy``'s model: idle power over the time, the rest by CPU time over the
    quota, J per byte; nothing over the record's ``away_s`` windows, (left, returned) seconds);
    None before it has a CPU sample."""
    t, cpu_ns = latest.get("time_s"), latest.get("cpu_ns")
    if t is None or cpu_ns is None or t <= 0:
        return None
    there_s = t - sum(max(0.0, min(t, back) - left) for left, back in device.get("away_s") or ())
    busy_s = min(cpu_ns / 1e9 / float(device["quota_cores"]), there_s)
    moved = (latest.get("tx_bytes") or 0) + (latest.get("rx_bytes") or 0)
    return (float(device["idle_w"]) * there_s + (float(device["max_w"]) - float(device["idle_w"])) * busy_s
            + float(device.get("e_byte_j") or 0.0) * moved)


def prometheus_text(run_id: str, nodes: list[dict[str, Any]], collector: Optional[Collector],
                    devices: Optional[dict[str, dict[str, Any]]] = None) -> bytes:
    """The Prometheus exposition of a run: per node its round, accuracy, loss and model bytes
    (as the node reports them), its monitors when it reports them (``MONITOR_GAUGES``, and
    ``edgetb_node_strategy`` labelled with the strategy, value 1) and, while sampled, its CPU,
    memory and traffic; per link its bytes, throughput, drops and utilisation of the configured
    rate; per host the sampler's CPU; per node of a device class (``devices``: node -> its record in
    topology.json) its modelled energy (``live_energy_j``). ``nodes``: dicts with name, round, accuracy, loss,
    bytes_sent and optionally the monitors (``controller.results.adaptation.monitor_fields``)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    node_labels, link_labels = ["run", "node"], ["run", "link", "src", "dst"]

    class _Metrics:
        def collect(self) -> Any:
            gauges = {
                "round": GaugeMetricFamily("edgetb_node_round", "Last round the node reported", labels=node_labels),
                "accuracy": GaugeMetricFamily("edgetb_node_accuracy", "Last accuracy the node reported",
                                              labels=node_labels),
                "loss": GaugeMetricFamily("edgetb_node_loss", "Last loss the node reported", labels=node_labels),
            }
            gauges.update({key: GaugeMetricFamily(name, doc, labels=node_labels)
                           for key, (name, doc) in MONITOR_GAUGES.items()})
            strategy = GaugeMetricFamily("edgetb_node_strategy", "The node's all-reduce strategy (value 1)",
                                         labels=[*node_labels, "strategy"])
            sent = CounterMetricFamily("edgetb_node_model_sent_bytes", "Bytes of model data the node reported sending",
                                       labels=node_labels)
            for n in nodes:
                values = {**n, **monitor_fields(n)}  # a malformed monitor is not shown
                for key, family in gauges.items():
                    if values.get(key) is not None:
                        family.add_metric([run_id, n["name"]], float(values[key]))
                sent.add_metric([run_id, n["name"]], float(n.get("bytes_sent") or 0))
                if values["strategy"] is not None:
                    strategy.add_metric([run_id, n["name"], values["strategy"]], 1.0)
            yield from gauges.values()
            yield strategy
            yield sent
            if collector is None:
                return
            cpu = CounterMetricFamily("edgetb_node_cpu_seconds", "CPU time of the node's cgroup since the run's start",
                                      labels=node_labels)
            mem = GaugeMetricFamily("edgetb_node_memory_bytes", "Memory of the node's cgroup", labels=node_labels)
            tx = CounterMetricFamily("edgetb_node_transmit_bytes", "Bytes the node's interface sent",
                                     labels=node_labels)
            rx = CounterMetricFamily("edgetb_node_receive_bytes", "Bytes the node's interface received",
                                     labels=node_labels)
            for name, e in sorted(collector.latest_nodes.items()):
                for family, key, scale in ((cpu, "cpu_ns", 1e-9), (mem, "mem_bytes", 1), (tx, "tx_bytes", 1),
                                           (rx, "rx_bytes", 1)):
                    if e.get(key) is not None:
                        family.add_metric([run_id, name], e[key] * scale)
            yield from (cpu, mem, tx, rx)
            energy = GaugeMetricFamily("edgetb_node_energy_joules", "Modelled energy of a device node since the "
                                       "run's start (a model: see the devices how-to)", labels=node_labels)
            for name, device in sorted((devices or {}).items()):
                value = live_energy_j(collector.latest_nodes.get(name, {}), device)
                if value is not None:
                    energy.add_metric([run_id, name], value)
            yield energy
            lbytes = CounterMetricFamily("edgetb_link_transmit_bytes", "Bytes sent through the link's HTB class",
                                         labels=link_labels)
            drops = CounterMetricFamily("edgetb_link_drops", "Packets the link's class dropped", labels=link_labels)
            thr = GaugeMetricFamily("edgetb_link_throughput_bps", "Throughput over the last sampling period, bit/s",
                                    labels=link_labels)
            util = GaugeMetricFamily("edgetb_link_utilisation_ratio", "Throughput / the link's configured rate",
                                     labels=link_labels)
            rate = GaugeMetricFamily("edgetb_link_rate_bps", "The link's configured rate, bit/s", labels=link_labels)
            for (src, dst), e in sorted(collector.latest_links.items()):
                labels = [run_id, f"{src}->{dst}", src, dst]
                if e.get("tx_bytes") is not None:
                    lbytes.add_metric(labels, e["tx_bytes"])
                if e.get("drops") is not None:
                    drops.add_metric(labels, e["drops"])
                bps = _bits(e.get("tx_bytes_per_s"))
                configured = collector.rates.now((src, dst))
                if bps is not None:
                    thr.add_metric(labels, bps)
                if configured:
                    rate.add_metric(labels, configured)
                    if bps is not None:
                        util.add_metric(labels, bps / configured)
            yield from (lbytes, drops, thr, util, rate)
            sampler = CounterMetricFamily("edgetb_telemetry_sampler_cpu_seconds", "CPU time of the host's sampler",
                                          labels=["run", "host"])
            for host in collector.hosts.values():
                if host.last.get("sampler_cpu_s") is not None:
                    sampler.add_metric([run_id, host.name], host.last["sampler_cpu_s"])
            yield sampler

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Metrics())
    return generate_latest(registry)
