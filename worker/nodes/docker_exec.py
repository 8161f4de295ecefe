"""A command run in a container through Docker's exec API, with ``subprocess.Popen``'s interface.

``ExecProcess`` is how the Docker runtime (``worker.nodes.docker``) runs node processes: the
worker treats them as it treats the ``Popen`` of a netns node (``pid``, ``poll``, ``wait``,
``communicate``, signals). ``Sink`` copies one output stream where ``Popen`` would have.
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from typing import Any, Iterator, Optional

from worker.api.errors import CapabilityError, ConfigError, NodeRuntimeError, NotFound, TestbedTimeout
from worker.kernel.procs import start_ticks


def sdk() -> Any:
    """The Docker SDK, imported when first needed (a clear error when it is not installed)."""
    try:
        import docker
    except ImportError:
        raise CapabilityError("the Docker SDK for Python is not installed: pip install 'edgetb[docker]' "
                              "(bash scripts/setup.sh with EDGETB_EXTRAS=test,docker)") from None
    return docker


def short_error(e: BaseException) -> str:
    """The first line of a Docker error's explanation."""
    explanation = getattr(e, "explanation", None)
    return str(explanation or e).strip().splitlines()[0] if str(explanation or e).strip() else type(e).__name__


class Sink:
    """Where one output stream of an exec goes: like Popen's stdout/stderr arguments."""

    def __init__(self, target: Any, inherit_fd: int) -> None:
        self.fd: Optional[int] = None
        self.chunks: Optional[list[bytes]] = None
        if target is None:
            self.fd = os.dup(inherit_fd)
        elif target == subprocess.PIPE:
            self.chunks = []
        elif target == subprocess.DEVNULL:
            pass
        elif isinstance(target, int) and target >= 0:
            self.fd = os.dup(target)
        elif hasattr(target, "fileno"):
            target.flush()
            self.fd = os.dup(target.fileno())
        else:
            raise ConfigError(f"unsupported output target {target!r}")

    def write(self, data: bytes) -> None:
        if self.chunks is not None:
            self.chunks.append(data)
        elif self.fd is not None:
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def value(self) -> Optional[bytes]:
        return b"".join(self.chunks) if self.chunks is not None else None


class ExecProcess:
    """A command running in a container through the exec API, with the interface of
    ``subprocess.Popen`` that the worker uses: ``pid`` (the host pid, a session leader),
    ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``, ``returncode``.
    Output is copied to the given targets by a thread; stdin is not attached."""

    PID_TIMEOUT_S = 30.0

    def __init__(self, api: Any, container: str, argv: list[str], env: dict[str, str], workdir: str,
                 stdin: Any = None, stdout: Any = None, stderr: Any = None) -> None:
        docker = sdk()
        if stdin not in (None, subprocess.DEVNULL):
            raise ConfigError("processes in Docker nodes take no input (stdin must be None or DEVNULL)")
        self.args = argv
        self.returncode: Optional[int] = None
        self._api = api
        self._out = Sink(stdout, 1)
        self._err = self._out if stderr == subprocess.STDOUT else Sink(stderr, 2)
        try:
            self._exec_id = api.exec_create(container, argv, stdout=True, stderr=True, stdin=False, tty=False,
                                            environment=env, workdir=workdir)["Id"]
            stream = api.exec_start(self._exec_id, stream=True, demux=True)
        except docker.errors.NotFound:
            self._close_sinks()
            raise NotFound(f"container {container} does not exist") from None
        except docker.errors.APIError as e:
            self._close_sinks()
            raise NodeRuntimeError(f"cannot run {argv[0]!r} in {container}: {short_error(e)}") from None
        self._pump = threading.Thread(target=self._drain, args=(stream,), daemon=True,
                                      name=f"exec-{container}")
        self._pump.start()
        self.pid, self._ticks = self._wait_pid(container)

    def _drain(self, stream: Iterator[tuple[Optional[bytes], Optional[bytes]]]) -> None:
        try:
            for out, err in stream:
                if out:
                    self._out.write(out)
                if err:
                    self._err.write(err)
        except Exception:  # the engine closed the stream (container removed): the output ends here
            pass
        finally:
            self._close_sinks()

    def _close_sinks(self) -> None:
        self._out.close()
        self._err.close()

    def _wait_pid(self, container: str) -> tuple[int, Optional[int]]:
        """The host pid, once the engine reports it; a command that could not start is an error."""
        deadline = time.monotonic() + self.PID_TIMEOUT_S
        while True:
            info = self._api.exec_inspect(self._exec_id)
            if info.get("Pid"):
                return info["Pid"], start_ticks(info["Pid"])
            if not info.get("Running") and info.get("ExitCode") is not None:
                self._pump.join(5)
                self.returncode = info["ExitCode"]
                message = (self._err.value() or self._out.value() or b"").decode(errors="replace").strip()
                if info["ExitCode"] in (126, 127):
                    raise NotFound(f"command not found or not executable in {container}: {self.args[0]!r}"
                                   + (f" ({message.splitlines()[-1]})" if message else ""))
                raise NodeRuntimeError(f"{self.args[0]!r} could not start in {container} "
                                       f"(exit code {info['ExitCode']})")
            if time.monotonic() > deadline:
                raise TestbedTimeout(f"{self.args[0]!r} in {container} did not start within {self.PID_TIMEOUT_S:g}s")
            time.sleep(0.005)

    def _alive(self) -> bool:
        return self._ticks is not None and start_ticks(self.pid) == self._ticks

    def poll(self) -> Optional[int]:
        if self.returncode is not None:
            return self.returncode
        if self._alive():
            return None
        docker = sdk()
        try:
            info = self._api.exec_inspect(self._exec_id)
        except docker.errors.NotFound:  # its container was removed, and the process with it
            self.returncode = -9
            return self.returncode
        if info.get("Running") or info.get("ExitCode") is None:
            return None
        self.returncode = int(info["ExitCode"])
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.005
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
        self._pump.join(2.0)  # let the last output reach its target (bounded: a daemon may hold the stream)
        return code

    def communicate(self, input: Optional[bytes] = None, timeout: Optional[float] = None
                    ) -> tuple[Optional[bytes], Optional[bytes]]:
        if input:
            raise ConfigError("processes in Docker nodes take no input")
        started = time.monotonic()
        self._pump.join(timeout)
        if self._pump.is_alive():
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(None if timeout is None else max(0.0, timeout - (time.monotonic() - started)))
        return self._out.value(), (None if self._err is self._out else self._err.value())

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)
