"""Headless Chromium for the dashboard tests: render a page, return its DOM, screenshot it.

Uses the system's chromium (Debian's `chromium` package; `.ci/run` installs it) in
its own headless mode, so no Python browser driver is needed. `--virtual-time-budget`
lets the page's timers and fetches run (a few polls) before the DOM is dumped. The
browser is kept off every non-loopback address: unknown host names do not resolve and
everything else goes to a proxy that is not there (loopback always bypasses it).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome")
FLAGS = [
    "--headless=new",
    "--no-sandbox",  # tests run as root in CI containers
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-default-apps",
    "--disable-extensions",
    "--no-pings",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE localhost, EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",
    "--window-size=1280,1600",
]


def find_chromium() -> str | None:
    return next((path for name in NAMES if (path := shutil.which(name))), None)


def need_chromium() -> str:
    """The browser's path; skips the test (one line) when there is none."""
    path = find_chromium()
    if path is None:
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return path


def _run(browser: str, profile: Path, args: list[str], timeout: float) -> str:
    proc = subprocess.run(
        [browser, *FLAGS, f"--user-data-dir={profile}", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, f"chromium exited {proc.returncode}: {proc.stderr[-2000:]}"
    return proc.stdout


def dump_dom(browser: str, url: str, workdir: Path, budget_ms: int = 3000) -> str:
    """The page's DOM after `budget_ms` of virtual time (its scripts have run), without
    the script elements themselves (their source would match what the page renders)."""
    dom = _run(
        browser,
        workdir / "chromium-profile",
        [f"--virtual-time-budget={budget_ms}", "--dump-dom", url],
        timeout=60,
    )
    return re.sub(r"<script\b.*?</script>", "", dom, flags=re.S)


def screenshot(browser: str, url: str, path: Path, budget_ms: int = 3000) -> Path:
    """A PNG of the rendered page at `path` (kept as the test's artifact)."""
    _run(
        browser,
        path.parent / "chromium-profile",
        [f"--virtual-time-budget={budget_ms}", f"--screenshot={path}", url],
        timeout=60,
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "chromium wrote no PNG"
    return path
