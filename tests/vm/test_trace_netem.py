"""A recording's delay and loss replayed on a real link, on Debian's stock kernel (sch_netem): a
trace CSV with delay_ms and loss_pct columns deploys the link at its first bin's values and each
tick changes its netem leaf in place (read back from the kernel, the stored plan verified), and
UDP probes see each bin's round-trip time."""
import statistics
import sys
import time

import pytest

from controller.model.topology import load_links
from controller.run.trace_replay import TraceReplay, traced_links
from tests.netns.conftest import report
from tests.vm.test_netem import PROBE_CODE, PROBE_PORT, leaf_of, probe

TRACE = "time_s,rate,delay_ms,loss_pct\n0,8mbit,40,0\n1,4mbit,5,0\n2,4mbit,0,20\n"


def test_a_recordings_delay_and_loss_change_the_netem_leaf_bin_by_bin(host, tmp_path, request):
    (tmp_path / "walk.csv").write_text(TRACE)
    (tmp_path / "links.json").write_text('{"a": [{"dest": "b", "trace": {"file": "walk.csv", "format": "csv", '
                                         '"bin_ms": 1000, "loop": false}}], "b": [{"dest": "a", "bw": "50mbit"}]}')
    topo = load_links(str(tmp_path / "links.json"))
    assert topo.links[("a", "b")].shape.delay_ms == 40.0 and topo.links[("a", "b")].shape.needs_netem
    a, b = host.create_nodes({"version": 1, "nodes": [{"name": "a"}, {"name": "b"}]})["nodes"]
    ips = {"a": a["ip"], "b": b["ip"]}
    host.set_links({"version": 1, "links": [{"src": s, "dst": d, "dst_ip": ips[d], "shape": link.shape.to_dict()}
                                            for (s, d), link in topo.links.items()]})
    host.start_process("b", {"version": 1, "argv": [sys.executable, "-c", PROBE_CODE, "serve", str(PROBE_PORT)]})
    time.sleep(0.5)
    leaf = leaf_of(host, "a", "b")
    assert leaf["kind"] == "netem" and leaf["delay_us"] == 40_000 and leaf["loss_pct"] == 0, leaf
    replay = TraceReplay(host, clock=lambda: 0.0, progress=lambda _: None)
    replay.t0 = 0.0
    replay.add(traced_links(topo))
    seen = []
    for t_s, delay_us, loss_pct, rate_bps in ((0.0, 40_000, 0.0, 8_000_000), (1.0, 5_000, 0.0, 4_000_000),
                                               (2.0, 1, 20.0, 4_000_000)):
        replay.tick(t_s)
        leaf = leaf_of(host, "a", "b")  # (verified: the stored plan follows the kernel)
        assert leaf["delay_us"] == delay_us and leaf["loss_pct"] == pytest.approx(loss_pct, abs=1e-4), (t_s, leaf)
        assert host.shaping("a")["kernel"]["classes"]["1:10"]["rate_bps"] == rate_bps
        got = probe(host, "a", ips["b"], 300, 0.005)
        seen.append((statistics.median(got["rtts_ms"]) if got["rtts_ms"] else None,
                     100 * (1 - len(got["rtts_ms"]) / got["sent"])))
    assert [row["changed"] for row in replay.rows] == [1, 1, 1], replay.rows  # (the first tick: its first values)
    for k, (rtt, lost) in enumerate(seen):
        report(request, f"bin {k}: median round trip ms", rtt if rtt is not None else -1.0)
        report(request, f"bin {k}: lost percent", lost)
    (rtt0, lost0), (rtt1, lost1), (rtt2, lost2) = seen
    assert 38 <= rtt0 <= 60 and lost0 < 3, seen  # 40 ms one way (b answers unshaped but for its 50 mbit)
    assert 4 <= rtt1 <= 20 and lost1 < 3, seen
    assert rtt2 < 10 and 12 <= lost2 <= 28, seen  # 20 % lost one way

