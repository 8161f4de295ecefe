"""The device classes' reference kernel, timed on this host (``controller.model.devices``).

``host_kernel_s`` is the median of ``CALIBRATION_RUNS`` timings, each in a fresh Python process
with one BLAS thread (argv list, no shell), measured once per process (``EDGETB_HOST_KERNEL_S``
set: that value instead, e.g. to replay a run's calibration). ``python -m controller.calibration``
prints the kernel's time on the machine it runs on, as a class file's ``kernel_s``.
"""
from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import time
from typing import Optional

from controller.model.devices import KERNEL_N, KERNEL_REPEATS
from worker.api.errors import ConfigError

CALIBRATION_RUNS = 3
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reference_kernel() -> float:
    """Run the kernel once in this process; its wall time in seconds (numpy's BLAS, as it is set up)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((KERNEL_N, KERNEL_N))
    b = rng.standard_normal((KERNEL_N, KERNEL_N))
    a @ b  # warm-up: pages touched, BLAS initialised
    t0 = time.perf_counter()
    for _ in range(KERNEL_REPEATS):
        a @ b
    return time.perf_counter() - t0


def calibrate_host_kernel_s(runs: int = CALIBRATION_RUNS, timeout_s: float = 120.0) -> float:
    """The median of ``runs`` timings of the kernel on this host, one BLAS thread, each in a fresh
    process (argv list, no shell)."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    times = []
    for _ in range(runs):
        try:
            out = subprocess.run([sys.executable, "-m", "controller.calibration", "--seconds"], env=env,
                                 capture_output=True, text=True, timeout=timeout_s, check=True,
                                 cwd=ROOT)
            times.append(float(out.stdout.strip()))
        except (subprocess.SubprocessError, OSError, ValueError) as e:
            raise ConfigError(f"device calibration: the reference kernel did not run here: {e}") from None
    return statistics.median(times)


_HOST_KERNEL_S: Optional[float] = None


def host_kernel_s() -> float:
    """``calibrate_host_kernel_s`` once per process (``EDGETB_HOST_KERNEL_S`` set: that value)."""
    global _HOST_KERNEL_S
    if _HOST_KERNEL_S is None:
        fixed = os.environ.get("EDGETB_HOST_KERNEL_S")
        if fixed:
            try:
                value = float(fixed)
                if not (math.isfinite(value) and value > 0):
                    raise ValueError
            except ValueError:
                raise ConfigError(f"EDGETB_HOST_KERNEL_S: expected a positive number of seconds, got {fixed!r}") \
                    from None
            _HOST_KERNEL_S = value
        else:
            _HOST_KERNEL_S = calibrate_host_kernel_s()
    return _HOST_KERNEL_S


def main(argv: list[str]) -> int:
    """``--seconds``: the kernel's time only (what the calibration reads); else a class file's line."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    seconds = reference_kernel()
    if "--seconds" in argv:
        print(f"{seconds:.6f}")
    else:
        print(f'reference kernel ({KERNEL_REPEATS} x {KERNEL_N}x{KERNEL_N} float64 products, one thread): '
              f'"kernel_s": {seconds:.4f}')
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main(sys.argv[1:]))
