"""Waiting for a Streamlit server a test started."""
from __future__ import annotations

import subprocess
import time
import urllib.request

import pytest


def wait_until_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str) -> None:
    """Return once ``url``'s Streamlit health check answers 200; fail the test with the server's
    output if it exits or does not answer within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    proc.kill()
    pytest.fail(f"{what} did not start: {proc.stdout.read().decode()[-3000:]}")
