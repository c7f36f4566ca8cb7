"""Headless chromium for the docs tests: found, or installed when missing, and run on one page.

A page under test reports by writing JSON into ``<pre id="kvframe-result">``; :func:`run_page`
loads it with the network cut off (every host name fails to resolve, so nothing can come from a
CDN) and returns that JSON from the page's final DOM.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ENSURE = Path(__file__).with_name("ensure_chromium.sh")
_RESULT = re.compile(r'<pre id="kvframe-result">(.*?)</pre>', re.S)


def chromium() -> str:
    """Path of Debian's ``chromium``; ``ensure_chromium.sh`` installs it first if missing."""
    found = shutil.which("chromium")
    if found is None:
        proc = subprocess.run(
            ["sh", str(ENSURE)], capture_output=True, text=True, timeout=900, check=False
        )
        found = shutil.which("chromium")
        if proc.returncode != 0 or found is None:
            pytest.fail(f"the docs tests need chromium and {ENSURE.name} failed: {proc.stderr}")
    return found


def run_page(url: str, profile: Path, *, budget_ms: int = 60_000, timeout_s: int = 120) -> Any:
    """Load ``url`` headless and return the JSON the page wrote into its result element.

    ``budget_ms`` is chromium's virtual time: idle waits (timers) take none of the real time.
    ``profile`` is a fresh directory for chromium's profile.
    """
    args = [
        chromium(),
        "--headless",
        "--no-sandbox",  # needed as root (CI), harmless otherwise: only local files load
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--allow-file-access-from-files",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        f"--virtual-time-budget={budget_ms}",
        "--dump-dom",
        url,
    ]
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout_s, check=False, env=_env()
    )
    found = _RESULT.search(proc.stdout)
    if found is None:
        tail = proc.stderr[-3000:]
        pytest.fail(f"chromium (exit {proc.returncode}) left no result on {url}: {tail}")
    return json.loads(html.unescape(found.group(1)))


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("DBUS_SESSION_BUS_ADDRESS", None)
    return env
