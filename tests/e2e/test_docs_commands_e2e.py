"""The calls the README and the Getting started page show, run as they are
written (curl, the `openai` SDK, grpcurl, the gRPC stubs) against the real
chain, with only its addresses swapped for the test's ports."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md", ROOT / "docs" / "api" / "grpc.md",
         ROOT / "docs" / "api" / "structured-output.md"]
BLOCK = re.compile(r"```(bash|python)\n(.*?)```", re.DOTALL)


def examples() -> list[tuple[str, str, str]]:
    """(page, language, code) of every call a page shows: curl, grpcurl, Python."""
    found = []
    for page in PAGES:
        for language, code in BLOCK.findall(page.read_text()):
            if language == "python" and ("OpenAI(" in code or "ChatServiceStub" in code):
                found.append((page.name, language, code))
            elif language == "bash" and code.lstrip().startswith(("curl http://127.0.0.1:8000", "grpcurl ")) \
                    and "'…'" not in code:
                found.append((page.name, language, code))
    return found


EXAMPLES = examples()


def test_every_page_shows_its_calls():
    assert {page for page, _, _ in EXAMPLES} == {p.name for p in PAGES}
    assert {code.split()[0] for _, language, code in EXAMPLES if language == "bash"} == {"curl", "grpcurl"}


@pytest.mark.parametrize(("page", "language", "code"), EXAMPLES,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(EXAMPLES)])
def test_the_call_runs_as_written(chain, page, language, code):
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{chain.edge_port}")
    code = code.replace("127.0.0.1:50051", f"127.0.0.1:{chain.tokenizer_port}")
    if language == "python":
        command = [sys.executable, "-c", code]
    else:
        code = re.sub(r"(?m)^grpcurl ", f"{Path(sys.executable).parent}/grpcurl ", code)  # the wheel's binary
        command = ["bash", "-euo", "pipefail", "-c", re.sub(r"(?m)^curl ", "curl -sS --fail-with-body --max-time 120 ",
                                                             code)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'gen'}:{ROOT}"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, (page, result.stdout[-1000:], result.stderr[-2000:])
    assert result.stdout.strip(), (page, code)
    if "grpcurl" in code:
        assert '"chunk"' in result.stdout and '"finish_reason": "FINISH_REASON_' in result.stdout
