"""The one logging setup: plain text lines by default, one JSON object per line
with STORMSERVE_LOG_FORMAT=json, and any other value refused before the service
starts."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.log import setup_logging

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def root_logger():
    """setup_logging replaces the root logger's handlers: put pytest's back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def emit(monkeypatch, capsys, log_format: str | None) -> list[str]:
    if log_format is not None:
        monkeypatch.setenv("STORMSERVE_LOG_FORMAT", log_format)
    log = setup_logging("tokenizer")
    log.info("ready on %d", 50051)
    logging.getLogger("stormserve.access").info("POST /x 200", extra={"fields": {"status": 200, "request_id": "r1"}})
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")
    return capsys.readouterr().err.splitlines()


def test_json_lines_when_asked(monkeypatch, capsys, root_logger):
    lines = emit(monkeypatch, capsys, " JSON ")
    assert len(lines) == 3
    ready, access, failed = (json.loads(line) for line in lines)
    assert {k: ready[k] for k in ("level", "service", "logger", "msg")} == {
        "level": "INFO", "service": "tokenizer", "logger": "stormserve.tokenizer", "msg": "ready on 50051"}
    assert ready["ts"].endswith("Z")
    assert access["status"] == 200 and access["request_id"] == "r1"
    assert failed["level"] == "ERROR" and "ValueError: bad" in failed["exc_info"]


def test_plain_text_by_default(monkeypatch, capsys, root_logger):
    monkeypatch.delenv("STORMSERVE_LOG_FORMAT", raising=False)
    lines = emit(monkeypatch, capsys, None)
    assert lines[0].endswith(" tokenizer INFO stormserve.tokenizer: ready on 50051")
    assert lines[1].endswith(" tokenizer INFO stormserve.access: POST /x 200")
    assert lines[2].endswith("ERROR stormserve.tokenizer: failed") and "ValueError: bad" in lines[-1]
    with pytest.raises(json.JSONDecodeError):
        json.loads(lines[0])


def test_another_format_is_refused(monkeypatch, root_logger):
    monkeypatch.setenv("STORMSERVE_LOG_FORMAT", "xml")
    with pytest.raises(SystemExit, match="STORMSERVE_LOG_FORMAT must be one of text, json, got 'xml'"):
        setup_logging("tokenizer")


def test_a_service_with_another_format_does_not_start():
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("STORMSERVE_", "OTEL_"))},
           "PYTHONPATH": f"{ROOT / 'gen'}{os.pathsep}{ROOT}", "STORMSERVE_LOG_FORMAT": "logfmt"}
    done = subprocess.run([sys.executable, "-m", "services.http_edge", "--port", "0"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "STORMSERVE_LOG_FORMAT must be one of text, json, got 'logfmt'" in done.stderr, done.stderr[-2000:]
