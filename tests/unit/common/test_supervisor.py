"""A service started by the supervisor goes when the supervisor goes, even by SIGKILL."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVICE = """
import os, sys, time
from pathlib import Path
from services.common.supervisor import SUPERVISOR_PID_ENV, exit_with_supervisor
exit_with_supervisor()
Path(sys.argv[1]).write_text(f"{os.getpid()} {os.environ.get(SUPERVISOR_PID_ENV, '-')}")
time.sleep(120)
"""

SUPERVISOR = """
import sys, time
from services.common.supervisor import Chain
Chain()._spawn("service", "fake_service", sys.argv[1])
time.sleep(120)
"""


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # dead, waiting for whoever adopted it to reap it


def _wait_for(condition, limit_s: float) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_a_service_gets_sigterm_when_its_supervisor_is_killed(tmp_path: Path):
    (tmp_path / "fake_service.py").write_text(SERVICE)
    ready = tmp_path / "ready"
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root / "gen"), str(root)])}
    supervisor = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(ready)], env=env)
    try:
        assert _wait_for(lambda: ready.exists() and ready.read_text(), 60), "the service never started"
        pid, inherited = ready.read_text().split()
        assert inherited == "-"  # taken out of the environment: its own children do not inherit it
        assert not _is_gone(int(pid))
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait()
        assert _wait_for(lambda: _is_gone(int(pid)), 30), "the service outlived its supervisor"
    finally:
        supervisor.kill()
        supervisor.wait()
