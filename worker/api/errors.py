"""The testbed's one exception hierarchy.

Every error the testbed raises on purpose is a ``TestbedError``. The REST layer
maps them to a status code and ``{"error": ..., "detail": ...}``; the CLI maps
them to a message and a non-zero exit code.
"""
from __future__ import annotations


class TestbedError(Exception):
    """Root of every error the testbed raises on purpose."""

    __test__ = False  # not a pytest test class
    http_status = 500
    code = "testbed_error"

    def __init__(self, message: str, detail: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_json(self) -> dict:
        return {"error": self.code, "detail": self.message if self.detail is None else self.detail,
                "message": self.message}


class ConfigError(TestbedError):
    """A configuration value (file, option, request body) is malformed."""

    http_status = 400
    code = "config_error"


class TestbedInUse(ConfigError):
    """The testbed id is held by another process, or holds a testbed this one did not create."""

    http_status = 409
    code = "testbed_in_use"


class TopologyError(ConfigError):
    """links.json or a nodes file describes an impossible network."""

    code = "topology_error"


class CapabilityError(TestbedError):
    """The host lacks something the experiment needs (a qdisc, cgroups, NFS, ...)."""

    http_status = 422
    code = "capability_error"


class ShapingError(TestbedError):
    """tc state could not be applied, or what the kernel holds differs from the plan."""

    code = "shaping_error"


class NodeRuntimeError(TestbedError):
    """Creating, running in or removing a node failed."""

    code = "runtime_error"


class NotFound(TestbedError):
    """A named node, process or resource does not exist."""

    http_status = 404
    code = "not_found"


class AuthError(TestbedError):
    """A state-changing call came without a valid token."""

    http_status = 401
    code = "unauthorized"


class AgentUnreachable(TestbedError):
    """A worker agent did not answer."""

    http_status = 502
    code = "agent_unreachable"


class TestbedTimeout(TestbedError):
    """Something did not happen within its deadline."""

    __test__ = False
    http_status = 504
    code = "timeout"
