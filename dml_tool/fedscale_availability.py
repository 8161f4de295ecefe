"""FedScale's client behaviour trace (a pickle) to an availability CSV a scenario replays:
``python3 dml_tool/fedscale_availability.py client_behave_trace availability.csv [--max-clients N]``.

The trace maps each client id to its record, whose ``active`` and ``inactive`` lists hold the
seconds at which the client came online and went offline (``active[i]`` to ``inactive[i]``; an
``active`` time without its ``inactive``: online until the end). The CSV has one row per such
interval, ``node,t_on_s,t_off_s`` with the client id as ``node`` (``controller.model.availability``;
in the scenario, ``"clients": "pick"`` lets each node play a client).

A pickle can run code when it is loaded. This tool refuses to run as root, and loads the file
with an unpickler that knows no class or function at all: only plain types (dicts, lists,
tuples, numbers, strings) load; anything else is refused, naming what the file asked for. The
CSV is checked as a scenario would check it before it is written (all or nothing).
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import os
import pickle
import sys
from typing import Any, Optional

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from controller.model.availability import HEADER, parse_csv  # noqa: E402
from worker.api.errors import ConfigError  # noqa: E402

MAX_PICKLE_BYTES = 512 * 1024 * 1024


class PlainUnpickler(pickle.Unpickler):
    """An unpickler of plain types: every global (class, function) the stream names is refused."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused: the pickle asks for {module}.{name}; only plain types "
                                     f"(dict, list, tuple, numbers, strings) are loaded")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused: the pickle holds a persistent reference")


def load_plain(data: bytes, source: str) -> Any:
    """The pickle's plain value; a ConfigError naming ``source`` for anything else."""
    try:
        return PlainUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError) as e:
        raise ConfigError(f"{source}: not a plain pickle of FedScale's client trace: {e}") from None


def _seconds(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: expected seconds (a number >= 0), got {value!r}")
    return float(value)


def trace_rows(trace: Any, source: str, max_clients: Optional[int] = None) -> list[tuple[str, float, Optional[float]]]:
    """(client, t_on_s, t_off_s or None) of every interval, clients in the trace's order."""
    if not isinstance(trace, dict):
        raise ConfigError(f"{source}: expected a dict of client id -> record, got {type(trace).__name__}")
    rows = []
    for i, (client, record) in enumerate(trace.items()):
        if max_clients is not None and i >= max_clients:
            break
        where = f"{source}: client {client!r}"
        if not isinstance(record, dict) or not isinstance(record.get("active"), (list, tuple)) \
                or not isinstance(record.get("inactive", []), (list, tuple)):
            raise ConfigError(f"{where}: expected a record with 'active' and 'inactive' lists of seconds")
        on = [_seconds(v, f"{where}, active[{k}]") for k, v in enumerate(record["active"])]
        off = [_seconds(v, f"{where}, inactive[{k}]") for k, v in enumerate(record.get("inactive", []))]
        if len(off) > len(on) or len(on) > len(off) + 1:
            raise ConfigError(f"{where}: {len(on)} 'active' times for {len(off)} 'inactive' ones")
        for k, start in enumerate(on):
            rows.append((str(client), start, off[k] if k < len(off) else None))
    return rows


def to_csv(rows: list[tuple[str, float, Optional[float]]]) -> bytes:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    w.writerow(HEADER)
    for client, on, off in rows:
        w.writerow([client, f"{on:g}", "" if off is None else f"{off:g}"])
    return out.getvalue().encode()


def convert(data: bytes, source: str, target: str, max_clients: Optional[int] = None) -> bytes:
    """The CSV of a FedScale trace's bytes, checked as a scenario reads it (errors name ``target``'s lines)."""
    text = to_csv(trace_rows(load_plain(data, source), source, max_clients))
    parse_csv(text, target)
    return text


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", help="FedScale's client behaviour trace (a pickle)")
    parser.add_argument("csv", help="the availability CSV to write")
    parser.add_argument("--max-clients", type=int, help="only the first N clients of the trace")
    args = parser.parse_args(argv)
    try:
        if os.geteuid() == 0:
            raise ConfigError("refusing to run as root: a pickle can run code when it is loaded; run this as an "
                              "ordinary user (the CSV it writes is what the testbed reads)")
        with open(args.trace, "rb") as f:
            data = f.read(MAX_PICKLE_BYTES + 1)
        if len(data) > MAX_PICKLE_BYTES:
            raise ConfigError(f"{args.trace}: larger than {MAX_PICKLE_BYTES} bytes")
        text = convert(data, args.trace, args.csv, args.max_clients)
        tmp = f"{args.csv}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(text)
        os.replace(tmp, args.csv)
    except (ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    intervals = text.count(b"\n") - 1
    print(f"{args.csv}: {intervals} intervals")
    return 0


if __name__ == "__main__":
    sys.exit(main())
