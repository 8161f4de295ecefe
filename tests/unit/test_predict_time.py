"""The analytic transfer times: payload plus the headers a shaped link carries, at its rate."""
from __future__ import annotations

import os

import pytest

from controller.predict import analytic
from controller.predict.setting import from_input_dir

RING4 = os.path.join(os.path.dirname(__file__), "data", "predict", "ring4", "inputs")


def test_a_send_takes_its_payload_and_the_tcp_ip_ethernet_headers_at_the_link_rate():
    terms = analytic.terms(from_input_dir(RING4))
    # n1 sends chunks 0, 3, 2 as float64 partial sums and 1, 0, 3 as float32 (2410 parameters
    # cut into 603, 603, 602, 602) to n2 over 20 Mbit/s: 21,688 bytes in segments of 1448
    # that the shaper counts as 1514
    assert terms["n1"].payload_sent_bytes == 21688
    assert terms["n1"].own_send_s == pytest.approx(21688 * 1514 / 1448 * 8 / 20e6, rel=1e-9)
    assert analytic.wire_s(1448, 1514 * 8) == pytest.approx(1.0)
