"""Fixtures of the browser tier: the dashboard in a real headless Chromium driven by selenium.

The tier skips, with the reason, where there is no root, no Debian chromium and chromedriver or
no selenium, unless ``EDGETB_REQUIRE_BROWSER=1`` (scripts/test.sh installs them and sets it):
then a missing piece fails the tier, so CI never skips it. Screenshots go to
``test-artifacts/browser/`` of the checkout (or $EDGETB_ARTIFACTS), kept after the run.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# the flags a closed network needs (no background connections, no first-run, no update checks)
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1600,1300")


def browser_skip_reason() -> Optional[str]:
    if os.geteuid() != 0:
        return "browser tier needs root (the live run's namespaces)"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            return f"no {path}: apt-get install chromium chromium-driver"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "no selenium: pip install -e '.[browser]'"
    return None


_REASON = browser_skip_reason()
_REQUIRED = os.environ.get("EDGETB_REQUIRE_BROWSER") == "1"
BROWSER = [pytest.mark.browser, pytest.mark.skipif(_REASON is not None and not _REQUIRED, reason=_REASON or "")]


def artifacts_dir() -> Path:
    path = Path(os.environ.get("EDGETB_ARTIFACTS", ROOT / "test-artifacts")) / "browser"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def browser() -> Iterator[Any]:
    """A headless Chromium (selenium WebDriver) with its console log kept; quit at the end."""
    if _REASON is not None:
        pytest.fail(f"EDGETB_REQUIRE_BROWSER=1 but {_REASON}") if _REQUIRED else pytest.skip(_REASON)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="edgetb-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def console_errors(driver: Any) -> list[dict[str, Any]]:
    """The page's console messages of level SEVERE since the last call."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def wait_for(driver: Any, script: str, timeout_s: float = 60.0, what: str = "") -> Any:
    """Poll ``script`` (JavaScript returning a value) until it is truthy; that value."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what or script}")
