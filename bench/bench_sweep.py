"""Issue 51's target: a sweep from one command against the same runs started one by one.

Copies the default 8-node gossip experiment into a temporary directory, runs ``edgetb sweep``
over a small grid (``--bw`` link rates x ``--seeds``; ``--sync`` rounds to keep it short), then
runs each run's own command (the argv the sweep recorded in state.json) again, one by one, each
timed from its start to its end. Prints both wall times, their ratio (target <= 1.3) and the
load average. Needs root. ``python bench/bench_sweep.py --bw 10mbit 40mbit --seeds 1 --sync 3``
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bw", nargs="+", default=["10mbit", "40mbit"], help="the link rates varied")
    p.add_argument("--seeds", nargs="+", type=int, default=[1], help="the repeats' seeds")
    p.add_argument("--epochs", nargs="+", type=int, default=None, help="the nodes' epochs varied (a third axis)")
    p.add_argument("--sync", type=int, default=3, help="rounds of each run (the default file has 20)")
    p.add_argument("--port", type=int, default=3417)
    p.add_argument("--subnet", default="10.163.0.0/16", help="a subnet no other testbed on this host uses")
    o = p.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-sweep-")
    os.chmod(tmp, 0o755)
    try:
        for name in ("links.json", "gl_dataset.json"):
            shutil.copy(os.path.join(ROOT, name), tmp)
        with open(os.path.join(ROOT, "gl_structure.json")) as f:
            structure = json.load(f)
        structure["sync"] = o.sync
        with open(os.path.join(tmp, "gl_structure.json"), "w") as f:
            json.dump(structure, f)
        tid = "b" + secrets.token_hex(2)
        with open(os.path.join(tmp, "sweep.json"), "w") as f:
            vary = {"links.*[*].bw": o.bw, **({"structure.node_list[*].epoch": o.epochs} if o.epochs else {})}
            json.dump({"vary": vary, "repeats": {"seeds": o.seeds},
                       "run": {"testbed_id": tid, "subnet": o.subnet, "port": o.port, "timeout_s": 600}}, f)
        env = dict(os.environ, EDGETB_STATE_DIR=os.path.join(tmp, "state"))
        load0 = os.getloadavg()
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "controller", "sweep", os.path.join(tmp, "sweep.json")],
                              cwd=ROOT, env=env, capture_output=True, text=True)
        sweep_s = time.monotonic() - t0
        if done.returncode != 0:
            print(done.stdout[-3000:], done.stderr[-3000:])
            for log in sorted(glob.glob(os.path.join(tmp, "dml_file", "sweeps", "sweep", "runs", "*", "output.log"))):
                with open(log) as f:
                    print(log, f.read()[-2000:])
            return 1
        with open(os.path.join(tmp, "dml_file", "sweeps", "sweep", "state.json")) as f:
            runs = sorted(json.load(f)["runs"].values(), key=lambda e: e["index"])
        one_s = []
        for entry in runs:  # the same argv, started one by one
            t = time.monotonic()
            r = subprocess.run(entry["command"], cwd=tmp, env=env, capture_output=True, text=True)
            one_s.append(time.monotonic() - t)
            if r.returncode != 0:
                print(r.stdout[-3000:])
                return 1
        load1 = os.getloadavg()
        print(json.dumps({"runs": len(runs), "sync": o.sync, "nodes": 8, "sweep_s": round(sweep_s, 1),
                          "sweep_runs_s": [e["seconds"] for e in runs],
                          "one_by_one_s": [round(s, 1) for s in one_s], "one_by_one_total_s": round(sum(one_s), 1),
                          "ratio": round(sweep_s / sum(one_s), 3), "load_before": load0, "load_after": load1}))
        return 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
