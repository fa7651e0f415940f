"""`python -m services.http_edge` starts, answers, and exits 0 on SIGTERM/SIGINT."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_status(url: str, timeout_s: float = 20) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                return reply.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except (urllib.error.URLError, OSError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_process_serves_and_stops_cleanly(sig: signal.Signals) -> None:
    port, dead_backend = free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "gen"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.http_edge", "--port", str(port),
         "--tokenizer-address", f"127.0.0.1:{dead_backend}", "--drain-timeout-s", "1"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        # No ChatService behind it: the edge is up but not healthy.
        assert wait_for_status(f"http://127.0.0.1:{port}/health") == 503
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, output.decode(errors="replace")
    assert b"Application shutdown complete" in output
