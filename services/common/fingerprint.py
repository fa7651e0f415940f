"""`system_fingerprint` (DeepSeek marks it required on every reply and chunk):
"the backend configuration that the model runs with".

It is `fp_` + 10 hex digits of a SHA-256 over the stormserve version, the
served model's id and its root (the weights it was loaded from). Those are
what decide the output for a given request and seed: a new release or other
weights change the fingerprint, so a client that logs it can tell why a
seeded reply changed. Nothing per process or per request goes in (no start
time, no pid, no host), so every replica of one build serving one model
agrees and a restart keeps it. Computed once per model, not per chunk.

The tokenizer sets it on every ChatChunk, so ChatService callers (the edge,
gRPC clients, Envoy's JSON transcoding) all get it, and on its ListModels
answer, where the edge finds it for a chunk that comes without one (the
weights' path is hashed in here and shown nowhere).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import tomllib
from pathlib import Path

_PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


@functools.cache
def stormserve_version() -> str:
    """The installed distribution's version, else the checkout's pyproject.toml."""
    try:
        return importlib.metadata.version("stormserve")
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        return tomllib.loads(_PYPROJECT.read_text(encoding="utf-8"))["project"]["version"]
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


@functools.lru_cache(maxsize=64)
def system_fingerprint(model_id: str, model_root: str) -> str:
    build = f"stormserve {stormserve_version()}\n{model_id}\n{model_root}"
    return "fp_" + hashlib.sha256(build.encode()).hexdigest()[:10]
