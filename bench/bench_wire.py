"""Can safetensors be the weights wire format at no cost in speed or node memory?

Run: ``.venv/bin/python bench/bench_wire.py [--repeat 40]`` (no root needed).
Three codecs of the same arrays (numpy MLP weights, float32):

- ``v1 (JSON header)``: the previous wire format (4-byte length, a JSON header
  with dtypes and shapes, the raw buffers), kept in this file for comparison;
- ``safetensors package``: ``safetensors.numpy.save``/``load`` (the message's
  meta, which safetensors limits to strings, as one JSON string);
- ``dml_app.wire.weights (v2)``: the wire format now, the safetensors layout
  written and read with numpy alone (no package import in a node).

For three model sizes (the default 64-64-10 MLP, about 1 M and 8 M parameters)
it measures the message size and the median encode and decode times (the
codecs run in turn, so none gets a warmer heap); then, in fresh processes,
what a node pays in memory: the RSS that importing the codec adds to a process
with numpy and ``dml_app.wire.weights`` loaded (what a node holds), and the RSS
growth while decoding an 8 M-parameter message and while encoding it
(the peak beyond the arrays themselves: the copies made on the way). Prints Markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from dml_app.models.numpy.mlp import NumpyMLP  # noqa: E402
from dml_app.wire import weights as wire  # noqa: E402

SIZES = {"default 64-64-10": [64, 64, 10], "~1 M params": [64, 13_300, 10], "~8 M params": [64, 2_000, 4_000, 10]}
META = {"from": "n12", "round": 7, "samples": 180}


# the previous wire format (version 1), kept here for the comparison: 4-byte big-endian
# header length, a JSON header with each array's dtype and shape, the raw buffers
def v1_encode(arrays: list[np.ndarray], meta: dict[str, Any]) -> bytes:
    specs = [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays]
    header = json.dumps({"version": 1, "meta": meta, "arrays": specs}).encode()
    return struct.pack(">I", len(header)) + header + b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)


def v1_decode(data: bytes) -> tuple[list[np.ndarray], dict[str, Any]]:
    view = memoryview(data)
    (hlen,) = struct.unpack(">I", view[:4])
    header = json.loads(bytes(view[4:4 + hlen]))
    arrays, offset = [], 4 + hlen
    for spec in header["arrays"]:
        dtype, shape = np.dtype(spec["dtype"]), tuple(spec["shape"])
        size = int(np.prod(shape)) * dtype.itemsize
        if offset + size > len(view):
            raise ValueError("past the end")
        arrays.append(np.frombuffer(view[offset:offset + size], dtype=dtype).reshape(shape).copy())
        offset += size
    return arrays, header["meta"]


def package_encode(arrays: list[np.ndarray], meta: dict[str, Any]) -> bytes:
    from safetensors.numpy import save

    return save({f"{i:04d}": a for i, a in enumerate(arrays)}, metadata={"edgetb": json.dumps(meta)})


def package_decode(data: bytes) -> tuple[list[np.ndarray], dict[str, Any]]:
    from safetensors.numpy import load

    tensors = load(data)
    return [tensors[k] for k in sorted(tensors)], {}


CODECS: dict[str, tuple[Callable[..., bytes], Callable[[bytes], Any]]] = {
    "v1 (JSON header)": (v1_encode, v1_decode),
    "safetensors package": (package_encode, package_decode),
    "dml_app.wire.weights (v2)": (wire.encode, wire.decode),
}


def interleaved(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median seconds of each function, the functions run in turn (no codec gets a warmer heap)."""
    for fn in fns.values():
        fn()  # warm up (imports, caches)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(repeat):
        order = list(fns) if i % 2 == 0 else list(reversed(fns))
        for name in order:
            t = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def speed(repeat: int) -> list[list[str]]:
    from safetensors.numpy import load

    rows = []
    for label, sizes in SIZES.items():
        arrays = NumpyMLP(sizes).get_weights()
        params = sum(a.size for a in arrays)
        n = repeat if params < 2_000_000 else max(9, repeat // 2)
        bodies = {name: enc(arrays, META) for name, (enc, _) in CODECS.items()}
        for name, (_, dec) in CODECS.items():
            back, _ = dec(bodies[name])
            assert all(np.array_equal(a, b) for a, b in zip(arrays, back)), name
            if not name.startswith("v1"):  # the same layout: the package reads those bytes
                assert all(np.array_equal(a, load(bodies[name])[f"{i:04d}"]) for i, a in enumerate(arrays)), name
        enc_s = interleaved({name: (lambda e=enc: e(arrays, META)) for name, (enc, _) in CODECS.items()}, n)
        dec_s = interleaved({name: (lambda d=dec, b=bodies[name]: d(b)) for name, (_, dec) in CODECS.items()}, n)
        for name in CODECS:
            rows.append([label, f"{params:,}", name, f"{len(bodies[name]):,}", f"{enc_s[name] * 1e3:.3f}",
                         f"{dec_s[name] * 1e3:.3f}"])
    return rows


MEMORY_PROBE = r"""
import json, sys
sys.path.insert(0, {root!r})
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
import numpy as np
from dml_app.wire import weights as wire
sys.path.insert(0, {bench!r})
before = rss()
codec = {codec!r}
if codec == "safetensors package":
    import safetensors.numpy
after_import = rss()
import bench_wire
body = open({message!r}, "rb").read()
dec = bench_wire.CODECS[codec][1]
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS to the current RSS
held = rss()
arrays, _ = dec(body)
decode_peak, kept = hwm() - held, rss() - held
del body
enc = bench_wire.CODECS[codec][0]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
held = rss()
body = enc(arrays, bench_wire.META)
print(json.dumps({{"import_mib": after_import - before, "peak_growth_mib": decode_peak, "kept_mib": kept,
                   "encode_peak_mib": hwm() - held, "message_mib": len(body) / 2**20}}))
"""


def memory() -> list[list[str]]:
    rows = []
    arrays = NumpyMLP(SIZES["~8 M params"]).get_weights()
    with tempfile.TemporaryDirectory() as tmp:
        for name, (enc, _) in CODECS.items():
            message = os.path.join(tmp, f"{name}.bin")
            with open(message, "wb") as f:
                f.write(enc(arrays, META))
            probe = MEMORY_PROBE.format(root=ROOT, bench=os.path.dirname(os.path.abspath(__file__)), codec=name,
                                        message=message)
            runs = [json.loads(subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                                              check=True).stdout) for _ in range(3)]
            rows.append([name, f"{statistics.median(r['import_mib'] for r in runs):.2f}",
                         f"{runs[0]['message_mib']:.1f}",
                         f"{statistics.median(r['peak_growth_mib'] for r in runs):.1f}",
                         f"{statistics.median(r['kept_mib'] for r in runs):.1f}",
                         f"{statistics.median(r['encode_peak_mib'] for r in runs):.1f}"])
    return rows


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=40, help="timed runs per codec and size (half for 8 M)")
    args = p.parse_args()
    import safetensors

    print(f"numpy {np.__version__}, safetensors {safetensors.__version__}, Python {sys.version.split()[0]}\n")
    print(table(["model", "parameters", "codec", "message bytes", "encode ms", "decode ms"], speed(args.repeat)))
    print()
    print(table(["codec", "import adds RSS MiB", "8 M message MiB", "decode: peak RSS growth MiB",
                 "decode: RSS kept MiB", "encode: peak RSS growth MiB"], memory()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
