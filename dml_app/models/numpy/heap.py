"""Freed memory kept for reuse while a net trains, given back to the system after.

A training step allocates a few dozen arrays of megabytes (a convolution's matrices, its outputs,
their gradients). glibc serves such sizes with fresh ``mmap`` pages or trims them off its heap
when they are freed, so every batch touches new pages: each a page fault and a page of zeros
(about 15 k faults and 40 ms of system time per 100 samples of the Fashion-MNIST CNN). Inside
``reuse_freed_memory()`` glibc keeps what is freed (``mallopt``: allocations up to 32 MiB from its
heap, no trimming), so the next batch reuses the same pages; on leaving, glibc's defaults are set
again and ``malloc_trim(0)`` gives the memory back, so a node between rounds holds what it held
before. With ``keep_s``, the memory is given back that many seconds after the call leaves unless
another call enters first (a round's training and its evaluations, back to back, then share the
pages: an evaluation of 100 samples no longer faults 7 k pages in); a native thread of its own
waits out the delay, whatever patches the process's threads (gevent). Without glibc (``mallopt``
missing) it does nothing.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import _thread
import sys
import time
from contextlib import contextmanager
from typing import Iterator, Optional

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
DEFAULT_THRESHOLD_BYTES = 128 * 1024  # glibc's default for both
KEEP_MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's own ceiling for its adaptive threshold
KEEP_TRIM_THRESHOLD_BYTES = 2**31 - 1  # (mallopt takes an int)


def _original(module: str, name: str, default: object) -> object:
    """``module.name`` as it was before gevent patched it: ``default`` (read now) unless gevent
    has patched the process already."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey.get_original(module, name) if monkey is not None else default


_allocate_lock = _original("_thread", "allocate_lock", _thread.allocate_lock)
_start_thread = _original("_thread", "start_new_thread", _thread.start_new_thread)
_sleep = _original("time", "sleep", time.sleep)
_lock = _allocate_lock()  # (native: taken by compute threads and the delayed release alike)
_inside = 0  # trainings under way in this process (the settings are the process')
_kept = False  # whether glibc keeps freed memory now (inside a call, or within a call's keep_s after it)
_entries = 0  # calls entered so far: a delayed release gives up when another call entered after it


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not all(hasattr(libc, name) for name in ("mallopt", "malloc_trim", "gnu_get_libc_version")):
        return None
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    return libc


_LIBC = _libc()


@contextmanager
def reuse_freed_memory(keep_s: float = 0.0) -> Iterator[None]:
    """Inside: freed memory stays with the process for the next allocations; after: returned
    (``keep_s`` seconds after leaving, unless another call enters first)."""
    global _inside, _kept, _entries
    if _LIBC is None:
        yield
        return
    with _lock:
        if not _kept:
            _LIBC.mallopt(M_MMAP_THRESHOLD, KEEP_MMAP_THRESHOLD_BYTES)
            _LIBC.mallopt(M_TRIM_THRESHOLD, KEEP_TRIM_THRESHOLD_BYTES)
            _kept = True
        _inside += 1
        _entries += 1
    try:
        yield
    finally:
        with _lock:
            _inside -= 1
            entries = _entries
            if _inside == 0 and keep_s <= 0:
                _release()
        if keep_s > 0:
            _start_thread(_release_later, (keep_s, entries))


def _release() -> None:
    """glibc's defaults again and the freed memory given back (the caller holds ``_lock``)."""
    global _kept
    if _kept and _inside == 0:
        _LIBC.mallopt(M_MMAP_THRESHOLD, DEFAULT_THRESHOLD_BYTES)
        _LIBC.mallopt(M_TRIM_THRESHOLD, DEFAULT_THRESHOLD_BYTES)
        _LIBC.malloc_trim(0)
        _kept = False


def _release_later(delay_s: float, entries: int) -> None:
    """``_release`` after ``delay_s``, unless a call entered meanwhile (its own end releases)."""
    _sleep(delay_s)
    with _lock:
        if _entries == entries:
            _release()


def give_back() -> None:
    """What a delayed release does, now (nothing while a call is inside)."""
    with _lock:
        _release()


def trim() -> None:
    """Give the heap's freed pages back to the system now (glibc's ``malloc_trim``; nothing
    without glibc)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)
