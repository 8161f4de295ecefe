"""The bodies of the agent's requests, declared with ``worker.api.schema`` (one mechanism for
files and requests): an unknown field, a wrong type or a value out of range is a ConfigError
naming the request and the field.

The worker checks a body's ``version`` first (``worker.api.protocol.check_version``), then its schema
here; what needs the host's state (does the node exist?) is checked where the request is
served. The nodes of ``POST /nodes`` are ``worker.nodes.runtime.NodeSpec``, a link's shape is
``worker.api.shape.Shape``, isolation ``worker.shaping.plan.Isolation`` and the faults of
``POST /faults`` ``worker.api.faults``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from worker.api.protocol import check_version
from worker.api.schema import ABSENT, IPV4_ADDRESS, MAX_SECONDS, Field, Schema
from worker.api.shape import MAX_DELAY_MS, MAX_RATE_BPS

REQUEST = "request"  # the place every message starts with
MIN_ACCESS_BPS = 8

VERSION = Field(int, "the API version", required=True)
NAME = Field(str, "a node name", required=True, max_len=64)
ADDRESS = dataclasses.replace(IPV4_ADDRESS, required=True)
ARGV = Field(list, "the command and its arguments", required=True, items=Field(str), min_items=1)
ENV = Field(dict, "environment variables of the process", nullable=True, values=Field(str))

CREATE_NODES = Schema({"version": VERSION,
                       "nodes": Field(list, "the nodes (NodeSpec)", required=True, items=Field(dict))})

LINK = Schema({"src": NAME, "dst": NAME, "dst_ip": ADDRESS,
               "shape": Field(dict, "how the link is shaped (null in a merging update: removed)", nullable=True)})
PEER = Schema({"dst": NAME, "dst_ip": ADDRESS})
ACCESS_BPS = Field(int, "bits per second (null: no access link)", nullable=True, default=ABSENT,
                   low=MIN_ACCESS_BPS, high=MAX_RATE_BPS)
ACCESS = Schema({"uplink_bps": ACCESS_BPS, "downlink_bps": ACCESS_BPS})
SET_LINKS = Schema({
    "version": VERSION,
    "links": Field(list, "the links to shape", required=True, items=Field(dict, schema=LINK)),
    "isolation": Field(dict, '{"drop": [...], "keep": [...]} or {"open": true}', default=ABSENT),
    "unshaped": Field(dict, "node -> the peers it reaches without a shaped link", default={},
                      values=Field(list, items=Field(dict, schema=PEER))),
    "access": Field(dict, "node -> its access links (a key left out keeps it)", default={},
                    values=Field(dict, schema=ACCESS))})

RATE = Schema({"src": NAME, "dst": NAME,
               "rate_bps": Field(int, "the link's new rate in bit/s", required=True, low=MIN_ACCESS_BPS,
                                 high=MAX_RATE_BPS),
               "delay_ms": Field(float, "its new delay in ms (its netem leaf's; a recording's column)", default=ABSENT,
                                 low=0, high=MAX_DELAY_MS),
               "loss_pct": Field(float, "its new loss in % (its netem leaf's)", default=ABSENT, low=0, high=100)})
SET_RATES = Schema({"version": VERSION,
                    "rates": Field(list, "links already shaped and their new rates (a recorded trace's bin)",
                                   required=True, items=Field(dict, schema=RATE), max_items=100_000)})

START_PROCESS = Schema({"version": VERSION, "argv": ARGV, "env": ENV})
EXEC = Schema({"version": VERSION, "argv": ARGV, "env": ENV,
               "timeout_s": Field(float, "seconds before it is killed", default=60.0, low=0, low_open=True,
                                  high=MAX_SECONDS)})
START_NODE = Schema({"version": VERSION, "args": Field(list, "dml_app.node's arguments", required=True,
                                                       items=Field(str)), "env": ENV})
START_CAPTURE = Schema({"version": VERSION, "snap_bytes": Field(int, "bytes kept of each packet", default=ABSENT)})


def checked(schema: Schema, body: Any) -> dict[str, Any]:
    """A request body of this API's version that ``schema`` accepts (ConfigError otherwise)."""
    return schema.validate(check_version(body), REQUEST)
