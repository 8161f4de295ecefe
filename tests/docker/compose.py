"""docker-compose.yml driven from tests and benchmarks: each on its own id, subnet, ports and
state directory, in a scratch experiment directory."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from pathlib import Path

from tests.e2e.harness import ROOT, free_port, make_workdir, wait_phase
from tests.netns.conftest import free_subnet


def compose_cli() -> list[str] | None:
    """``docker compose`` (v2) where the plugin is there, else ``docker-compose`` (v1)."""
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    return ["docker-compose"] if shutil.which("docker-compose") else None


class Compose:
    """docker-compose.yml brought up on its own id, subnet, ports and state directory."""

    def __init__(self, tmp: Path, cli: list[str], links: dict, structure: dict) -> None:
        self.workdir = make_workdir(tmp, structure=structure, links=links)
        self.id = "c" + secrets.token_hex(2)
        self.port, agent_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        state = tmp / f"state-{self.id}"
        (self.workdir / "hosts.json").write_text(json.dumps({"version": 1, "hosts": [
            {"name": "local", "agent": f"http://127.0.0.1:{agent_port}", "runtime": "docker"}]}))
        self.env = dict(os.environ, EDGETB_EXPERIMENT=str(self.workdir), EDGETB_HOSTS="hosts.json",
                        EDGETB_ID=self.id, EDGETB_SUBNET=free_subnet(), EDGETB_PORT=str(self.port),
                        EDGETB_AGENT_PORT=str(agent_port), EDGETB_STATE_DIR=str(state))
        self.argv = [*cli, "-p", f"edgetb{self.id}", "-f", str(ROOT / "docker-compose.yml")]

    def run(self, *args: str, timeout_s: float = 180) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.argv, *args], env=self.env, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"compose {' '.join(args)} failed:\n{done.stdout}{done.stderr}"
        return done

    def down(self, check: bool = True) -> None:
        """``compose down``: the controller resets the nodes on SIGTERM before the agent stops."""
        if check:
            self.run("down", "--timeout", "60", timeout_s=300)
        else:
            subprocess.run([*self.argv, "down", "--timeout", "60"], env=self.env, capture_output=True, timeout=300)

    def logs(self) -> str:
        return subprocess.run([*self.argv, "logs", "--no-color"], env=self.env, capture_output=True, text=True,
                              timeout=60).stdout

    def wait_phase(self, *phases: str, timeout_s: float = 120) -> dict:
        try:
            return wait_phase(self.url, phases, timeout_s)
        except AssertionError as e:
            raise AssertionError(f"{e}; compose logs:\n{self.logs()[-4000:]}") from None
