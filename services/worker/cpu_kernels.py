"""Native CPU kernels (kernels/*.c), built on first use with the system C compiler.

Paged attention is the one kernel so far. torch's CPU attention (SDPA) pays a
fixed cost per (sequence, head) that dwarfs the work of one decode row over a
few hundred keys, runs short causal prefills at about 100 GFLOP/s, and reading
K/V through a block table first needs a gather. paged_attention.c reads the
pool in place and attends every row of a step, decodes and prefill chunks, in
one call per layer. The pure-torch path (attention.py) stays the reference, and
the fallback where no compiler or no kernel exists (other devices, float16).

The library is built for this CPU (-march=native) into the stormserve cache,
keyed by the source, the flags, the compiler and the CPU's flags, so a changed
machine never loads a build made for another. It links the OpenMP runtime by
soname, which resolves to the libgomp torch has already loaded: the kernel runs
on torch's thread team rather than a second one competing for the cores.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from services.common.model_files import cache_root

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "kernels" / "paged_attention.c"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_ENTRY_POINTS = {torch.float32: "paged_attention_f32", torch.bfloat16: "paged_attention_bf16"}
# As in paged_attention.c: head_dim must be a multiple of LANES, heads / kv_heads at most MAX_GROUP.
_LANES = 16
_MAX_GROUP = 16
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str) -> Path:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    key = hashlib.sha256(
        "\0".join([_SOURCE.read_text(), " ".join(_FLAGS), version, _cpu_flags()]).encode()
    ).hexdigest()[:16]
    target = cache_root() / "kernels" / f"{_SOURCE.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
                       capture_output=True, text=True, check=True)
        os.replace(built, target)
    log.info("built %s", target)
    return target


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: attention runs on torch's SDPA (slower)")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU attention kernel failed, using torch's SDPA: %s", detail)
        return None
    for name in _ENTRY_POINTS.values():
        function = getattr(library, name)
        function.argtypes = _ARGTYPES
        function.restype = ctypes.c_int
    return library


class PagedAttention:
    """Attention of every row of one step in one layer: q [T, heads, dim] -> [T, heads, dim]."""

    def __init__(self, function):
        self._function = function

    def __call__(
        self,
        query: torch.Tensor,  # [T, heads, head_dim], packed as the step lays rows out
        key_cache: torch.Tensor,  # [num_slots, kv_heads, head_dim], one layer, the step's K/V written
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        starts: torch.Tensor,  # [num_seqs] int64, each sequence's first row
        num_new: torch.Tensor,  # [num_seqs] int64, its rows
        context_lens: torch.Tensor,  # [num_seqs] int64, its context, new rows included
        block_size: int,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        query = query.contiguous()
        num_heads, head_dim = query.shape[1:]
        out = torch.empty_like(query)
        status = self._function(
            query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
            starts.data_ptr(), num_new.data_ptr(), context_lens.data_ptr(), out.data_ptr(),
            block_tables.shape[0], num_heads, key_cache.shape[1], head_dim, block_tables.shape[1], block_size,
            scale, sliding_window or 0,
        )
        if status != 0:
            raise MemoryError("paged attention: out of memory for its scratch buffers")
        return out


def paged_attention(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> PagedAttention | None:
    """The kernel for a CPU pool of `dtype` and this attention shape, or None where
    there is none (then attention.py's SDPA path runs)."""
    name = _ENTRY_POINTS.get(dtype)
    supported = head_dim % _LANES == 0 and num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= _MAX_GROUP
    library = _library() if name is not None and supported else None
    return None if library is None else PagedAttention(getattr(library, name))
