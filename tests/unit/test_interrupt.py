"""A stop signal that lands in a request greenlet reaches the run's main flow once that request is done."""
from __future__ import annotations

import signal
import threading

import gevent
import pytest

from controller import runner


def test_an_interrupt_in_a_request_reaches_the_main_flow_after_the_request():
    lock = threading.Lock()  # a real lock, as the live view's: a request parked holding it blocks the thread
    done = []

    def request() -> None:
        with lock:
            runner._interrupt(signal.SIGHUP, None)  # the signal handler, run where the signal landed
            done.append("request")

    gevent.spawn(request)
    with pytest.raises(KeyboardInterrupt, match="SIGHUP"):
        gevent.sleep(2)  # the main flow, serving
    assert done == ["request"] and not lock.locked()


def test_an_interrupt_in_the_main_flow_is_raised_there():
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        runner._interrupt(signal.SIGTERM, None)
