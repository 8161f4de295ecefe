"""EdgeTB end to end on Debian's stock kernel: gl_run.py, four gossip nodes in a ring whose links
have delay and jitter (netem under HTB), a few rounds, results collected, everything removed."""
import json
from pathlib import Path

from worker.host import WorkerHost


def test_gossip_on_links_with_delay(run):
    ring = {f"n{i}": [{"dest": f"n{i % 4 + 1}", "bw": "10mbit", "delay": "20ms", "jitter": "2ms"},
                      {"dest": f"n{(i - 2) % 4 + 1}", "bw": "10mbit", "delay": "20ms", "jitter": "2ms"}]
            for i in range(1, 5)}
    structure = {"sync": 3, "wait_s": 1, "model": {"kind": "numpy", "hidden": [32], "learning_rate": 0.01, "seed": 0},
                 "node_list": [{"name": f"n{i}", "epoch": 1} for i in range(1, 5)]}
    r = run(structure=structure, links=ring)
    ready = r.wait_phase("ready", timeout_s=240)
    assert len(ready["nodes"]) == 4 and all(n["up"] and n["shaping_verified"] for n in ready["nodes"]), ready
    shaping = WorkerHost(r.id, r.subnet, state_root=str(r.state)).shaping("n1")
    assert shaping["verified"], shaping["mismatches"]
    leaves = [leaf for leaf in shaping["kernel"]["leaves"].values() if leaf["kind"] == "netem"]
    assert len(leaves) == 2 and all(l["delay_us"] == 20_000 and l["jitter_us"] == 2_000 for l in leaves), leaves

    assert r.get("/start").json()["phase"] == "running"
    done = r.wait_phase("finished", timeout_s=300)
    assert done["done"] == 4 and done["failed"] == 0, done
    summary = r.get("/finish").json()
    run_dir = Path(summary["run_dir"])
    assert sorted(p.name for p in (run_dir / "events").iterdir()) == [f"n{i}.jsonl" for i in range(1, 5)]
    links = json.loads((r.workdir / "links.json").read_text())
    for node in summary["nodes"]:
        assert node["rounds"] == 3 and node["ended"] == "done", node
        assert node["bytes_sent"] > 0 and 0 < node["accuracy"] <= 1, node
        assert set(node["sent_to"]) <= {l["dest"] for l in links[node["node"]]}, node
    r.get("/emulated/reset")
    assert r.proc.wait(timeout=60) == 0
