"""A node's computation (training, evaluation) on a thread of its own, off the event loop.

A node serves HTTP on gevent's event loop: peers' models, ``/health``, the controller's signed
calls and relays. Training for tens of seconds on that loop would leave all of them unanswered,
so a peer's upload would time out and the peer would be taken for dead. ``ComputeThread`` runs
the model's calls on one real thread (numpy and TensorFlow release the GIL in their kernels);
the greenlet that asked waits, the loop goes on serving. One thread per node keeps the model's
calls in order, as they were on the loop: an E-tree node on several layers never trains twice
at once.

``THREAD_ENV`` keeps numeric libraries to one thread each. It must be in a process's environment
before numpy is imported (OpenBLAS sizes its pool once, at load): hundreds of nodes share a few
cores, and a pool per node of a thread per core would spin against each other. ``NODE_ENV`` adds
two malloc arenas at most (glibc makes up to 8 per core, each holding freed memory: a node has
two threads). Both are read once, when a process starts: a node forked by the zygote has the
zygote's, so the zygote starts with ``NODE_ENV`` too.
"""
from __future__ import annotations

from typing import Any, Callable, TypeVar

T = TypeVar("T")

THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
              "NUMEXPR_NUM_THREADS": "1", "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "1"}
NODE_ENV = {**THREAD_ENV, "MALLOC_ARENA_MAX": "2",  # what every node process starts with
            "TF_CPP_MIN_LOG_LEVEL": "2"}  # (TensorFlow: warnings and errors only)


def inline(fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` on the caller's thread (in-memory tests, a role without a node around it)."""
    return fn(*args)


class ComputeThread:
    """One native thread that runs a node's model calls; ``run`` blocks only the calling greenlet."""

    def __init__(self) -> None:
        from gevent.threadpool import ThreadPool

        self._pool = ThreadPool(1)

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return self._pool.apply(fn, args)
