"""Native CPU kernels (kernels/*.c), built on first use with the system C compiler.

- Paged attention (paged_attention.c). torch's CPU attention (SDPA) pays a
  fixed cost per (sequence, head) that dwarfs the work of one decode row over a
  few hundred keys, runs short causal prefills at about 100 GFLOP/s, and
  reading K/V through a block table first needs a gather. The kernel reads the
  pool in place and attends every row of a step, decodes and prefill chunks,
  in one call per layer.
- One-pass RMSNorm, rotary embedding and SiLU-times-up (elementwise.c), which
  torch runs as several passes each over activations that a prefill step no
  longer holds in cache.
- bfloat16 linears (linear.c): on vdpbf16ps where the CPU has AVX512_BF16,
  1.1 to 1.9 times oneDNN's speed at 12 to 64 rows on the bundled model's
  shapes, level with it at 1,024 rows; on float32 FMAs over weights widened in
  registers where it has AVX2 and no AVX-512, on which oneDNN only emulates
  bfloat16. There also exactly-4-bit weights (int4.py) for steps of a few
  rows, where torch's int4 kernel is slower than a float32 matmul. The same
  tiles run a mixture-of-experts layer's experts in one call (GroupedLinear).
- Integer dot-product linears (int8.c) on AVX512_VNNI, AVX-VNNI or AVX2: int8
  weights (W8A8, dynamic or msModelSlim's static activation quantisation) and
  exactly-4-bit ones (W4A8), the activations quantised to int8 per call; their
  Python side is int8_kernels.py.

The pure-torch paths (attention.py, decoder.py) stay the reference the tests
hold these to, and the fallback where no compiler or no kernel exists (other
devices, float16, sizes the kernels do not take).

All sources build into one library for this CPU (-march=native) in the
stormserve cache, keyed by the sources, the flags, the compiler and the CPU's
flags, so a changed machine never loads a build made for another. It links the
OpenMP runtime by soname, which resolves to the libgomp torch has already
loaded: the kernels run on torch's thread team rather than a second one
competing for the cores.
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

_KERNELS = Path(__file__).parent / "kernels"
_FLAGS = ("-O3", "-march=native", "-fopenmp", "-fPIC", "-shared")
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# As in the sources: vectors of LANES floats; heads / kv_heads at most MAX_GROUP.
_LANES = 16
_MAX_GROUP = 16
_SIGNATURES: dict[str, list] = {
    "paged_attention": [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64],
    "rms_norm": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                 ctypes.c_int64, ctypes.c_float],
    "silu_mul": [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64],
    "rotary": [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
               ctypes.c_int64, ctypes.c_int64],
}


def cpu_has(flag: str) -> bool:
    """Whether /proc/cpuinfo lists `flag` (as "avx512_bf16") for this CPU."""
    return flag in _cpu_flags().split()


@functools.cache
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build(compiler: str, kernels: Path, extra_flags: tuple[str, ...] = ()) -> Path:
    """The library of the sources in `kernels` built for this CPU, from the cache or now.
    `extra_flags` follow -march=native (tests and benches: -mno-avx512f builds the
    AVX2 kernels on an AVX-512 CPU)."""
    sources = sorted(kernels.glob("*.c"))
    flags = (*_FLAGS, *extra_flags)
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [p.read_text() for p in sorted(kernels.glob("*.[ch]"))]
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, _cpu_flags()]).encode()).hexdigest()[:16]
    target = cache_root() / "kernels" / f"cpu_kernels-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: workers starting together never load a partial file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, sources), "-o", str(built), "-lm"],
                       capture_output=True, text=True, check=True)
        os.replace(built, target)
    log.info("built %s", target)
    return target


@functools.cache
def this_library() -> ctypes.CDLL | None:
    """This tree's kernels built for this CPU (load_library), once per process."""
    return load_library(_KERNELS)


def load_library(kernels: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The kernels of the sources in `kernels` (this tree's, or another checkout's for
    bench/attention_ab.py), built (with `extra_flags`, see _build) and loaded with
    their signatures; None without a compiler or where the build fails."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler: attention and norms run in plain torch (slower)")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, kernels, tuple(extra_flags))))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building the CPU kernels failed, running plain torch instead: %s", detail)
        return None
    for kernel, argtypes in _SIGNATURES.items():
        for suffix in _SUFFIXES.values():
            function = getattr(library, f"{kernel}_{suffix}")
            function.argtypes = argtypes
            function.restype = ctypes.c_int if kernel == "paged_attention" else None
    if hasattr(library, "linear_bf16"):  # built only for CPUs with AVX512_BF16, or AVX2 without AVX-512
        library.pack_linear_bf16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        library.pack_linear_bf16.restype = None
    if hasattr(library, "linear_q4"):  # as linear_bf16; each build lays the codes out its own way
        library.pack_linear_q4.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
        library.pack_linear_q4.restype = None
        library.q4_packed_bytes.argtypes = [ctypes.c_int64] * 2
        library.q4_packed_bytes.restype = ctypes.c_int64
    for kernel in ("linear_bf16", "linear_q4"):
        if hasattr(library, kernel):
            getattr(library, kernel).argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3
            getattr(library, kernel).restype = ctypes.c_int
    if hasattr(library, "moe_combine_bf16"):  # kernels/moe.c (a checkout older than it has none)
        library.moe_combine_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        library.moe_combine_bf16.restype = None
    if hasattr(library, "grouped_linear_bf16"):  # beside linear_bf16 (a checkout older than it has none)
        library.grouped_linear_bf16.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_void_p] + \
            [ctypes.c_int64] * 2
        library.grouped_linear_bf16.restype = ctypes.c_int
    if hasattr(library, "linear_w8a8"):  # kernels/int8.c, built for AVX512_VNNI, AVX-VNNI or AVX2
        for packer in ("pack_linear_w8a8", "pack_linear_q4a8"):
            getattr(library, packer).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p]
            getattr(library, packer).restype = None
        for size in ("w8a8_packed_bytes", "q4a8_packed_bytes"):
            getattr(library, size).argtypes = [ctypes.c_int64] * 2
            getattr(library, size).restype = ctypes.c_int64
        library.linear_w8a8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4 + [ctypes.c_void_p]
        library.linear_q4a8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
        library.linear_w8a8.restype = library.linear_q4a8.restype = ctypes.c_int
        library.int8_isa.argtypes, library.int8_isa.restype = [], ctypes.c_int64
    return library


def _function(kernel: str, dtype: torch.dtype):
    """The kernel's entry point for `dtype`, or None (no such dtype, no library)."""
    suffix = _SUFFIXES.get(dtype)
    library = this_library() if suffix is not None else None
    return None if library is None else getattr(library, f"{kernel}_{suffix}")


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
    if head_dim % _LANES or num_heads % num_kv_heads or num_heads // num_kv_heads > _MAX_GROUP:
        return None
    function = _function("paged_attention", dtype)
    return None if function is None else PagedAttention(function)


class LayerOps:
    """RMSNorm, rotary embedding and SiLU-times-up of one dtype, one pass each."""

    def __init__(self, dtype: torch.dtype):
        self._rms_norm = _function("rms_norm", dtype)
        self._silu_mul = _function("silu_mul", dtype)
        self._rotary = _function("rotary", dtype)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [rows, dim] (rows may be strided) -> a new contiguous [rows, dim]."""
        rows, dim = x.shape
        out = torch.empty((rows, dim), dtype=x.dtype)
        self._rms_norm(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, dim, eps)
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [rows, 2 * dim] (contiguous) -> silu(gate) * up [rows, dim]."""
        rows, dim = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, dim), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, dim)
        return out

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotary embedding in place on x [rows, heads, head_dim] (rows may be
        strided, heads contiguous), cos and sin [rows, head_dim]; returns x."""
        rows, heads, head_dim = x.shape
        self._rotary(x.data_ptr(), x.stride(0), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
                     rows, heads, head_dim)
        return x


def layer_ops(dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_dim: int) -> LayerOps | None:
    """One-pass layer ops for CPU tensors of `dtype` and these sizes, or None
    where there are none (then decoder.py runs the torch ops)."""
    if hidden_size % _LANES or intermediate_size % _LANES or head_dim % (2 * _LANES):
        return None
    if _function("rms_norm", dtype) is None:
        return None
    return LayerOps(dtype)


class PackedLinear:
    """y = x @ weight.T + bias (+ residual) for bfloat16 x [..., in], on one of
    linear.c's kernels with the weight packed once for it."""

    def __init__(self, function, packed: torch.Tensor, out_features: int, in_features: int,
                 bias: torch.Tensor | None):
        self._function = function
        self._packed = packed
        self._out_features, self._in_features = out_features, in_features
        self._bias = None if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or (residual is not None and residual.dtype != torch.bfloat16):
            raise TypeError(f"the bfloat16 linear kernel got {x.dtype} activations")
        shape = (*x.shape[:-1], self._out_features)
        # The kernel reads whole rows of in_features: other shapes would read past x or residual.
        if x.shape[-1] != self._in_features or (residual is not None and residual.shape != shape):
            raise ValueError(f"the linear maps [..., {self._in_features}] to {shape}, got {tuple(x.shape)}"
                             + ("" if residual is None else f" and a {tuple(residual.shape)} residual"))
        x = x.contiguous()
        out = torch.empty(shape, dtype=torch.bfloat16)
        if residual is not None:
            residual = residual.contiguous()
        status = self._function(
            x.data_ptr(), self._packed.data_ptr(), None if self._bias is None else self._bias.data_ptr(),
            None if residual is None else residual.data_ptr(), out.data_ptr(),
            x.numel() // self._in_features, self._out_features, self._in_features,
        )
        if status != 0:
            raise MemoryError("linear kernel: out of memory for its float32 rows")
        return out


def bfloat16_linear_available() -> bool:
    """Whether this CPU runs bfloat16 linears on linear.c (see packed_linear)."""
    library = this_library()
    return library is not None and hasattr(library, "linear_bf16")


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, *,
                  library: ctypes.CDLL | None = None) -> PackedLinear | None:
    """The bfloat16 linear kernel for `weight` [out, in], or None where there is
    none: not bfloat16, out not a multiple of 16 or in odd, or a CPU (or
    compiler) with neither AVX512_BF16 nor AVX2 (without AVX-512). `library`:
    another build of the kernels (load_library) in place of this CPU's."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or out_features % _LANES or in_features % 2:
        return None
    library = library if library is not None else this_library()
    if library is None or not hasattr(library, "linear_bf16"):
        return None
    weight = weight.detach().contiguous()
    packed = torch.empty(out_features * in_features, dtype=torch.bfloat16)
    library.pack_linear_bf16(weight.data_ptr(), out_features, in_features, packed.data_ptr())
    return PackedLinear(library.linear_bf16, packed, out_features, in_features, bias)


def q4_linear_available() -> bool:
    """Whether this CPU runs exactly-4-bit weights on linear.c (as bfloat16_linear_available)."""
    library = this_library()
    return library is not None and hasattr(library, "linear_q4")


def packed_q4_linear(codes: torch.Tensor, scale: torch.Tensor, low: torch.Tensor,
                     bias: torch.Tensor | None, *, library: ctypes.CDLL | None = None) -> PackedLinear | None:
    """linear.c's 4-bit kernel for a weight of codes [out, in] (0..15) times
    scale plus low per group of 32 inputs ([out, in / 32], int4.four_bit_codes),
    or None where there is none (see q4_linear_available; `library` as in
    packed_linear)."""
    out_features, in_features = codes.shape
    library = library if library is not None else this_library()
    if library is None or not hasattr(library, "linear_q4"):
        return None
    size = library.q4_packed_bytes(out_features, in_features)
    if size < 0:  # a shape the layout does not take
        return None
    codes = codes.to(torch.uint8).contiguous()
    scale, low = scale.float().contiguous(), low.float().contiguous()
    packed = torch.empty(size, dtype=torch.uint8)
    library.pack_linear_q4(codes.data_ptr(), scale.data_ptr(), low.data_ptr(), out_features, in_features,
                           packed.data_ptr())
    return PackedLinear(library.linear_q4, packed, out_features, in_features, bias)


class GroupedLinear:
    """The linears of a mixture-of-experts layer's experts in one call: rows
    offsets[g] to offsets[g + 1] of x [rows, in] (bfloat16) through expert g's
    weight, on linear.c's grouped kernel with every weight packed once."""

    def __init__(self, function, packed: torch.Tensor, groups: int, out_features: int, in_features: int):
        self._function = function
        self._packed = packed
        self.groups, self.out_features, self.in_features = groups, out_features, in_features

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """x [rows, in] sorted by group; offsets [groups + 1] int64 on the CPU,
        each group's first row, then the end. Rows past offsets[-1] come out 0."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"the grouped linear takes bfloat16 [rows, {self.in_features}], got {x.dtype} "
                             f"{tuple(x.shape)}")
        # The kernel reads rows up to offsets[-1] and each group's weight: bounds checked here, once.
        if offsets.dtype != torch.int64 or offsets.shape != (self.groups + 1,) or int(offsets[0]) != 0 \
                or int(offsets[-1]) > x.shape[0] or bool((offsets[1:] < offsets[:-1]).any()):
            raise ValueError(f"offsets must be {self.groups + 1} non-decreasing int64 from 0 to at most {x.shape[0]}")
        x, offsets = x.contiguous(), offsets.contiguous()
        end = int(offsets[-1])
        out = torch.empty((x.shape[0], self.out_features), dtype=torch.bfloat16)
        out[end:] = 0
        status = self._function(x.data_ptr(), self._packed.data_ptr(), offsets.data_ptr(), self.groups,
                                out.data_ptr(), self.out_features, self.in_features)
        if status != 0:
            raise MemoryError("grouped linear kernel: out of memory for its work list")
        return out


def packed_grouped_linear(weights: torch.Tensor) -> GroupedLinear | None:
    """linear.c's grouped kernel for bfloat16 weights [groups, out, in], or None
    where there is none (as packed_linear: the layout, the CPU, the build)."""
    groups, out_features, in_features = weights.shape
    if weights.dtype != torch.bfloat16 or out_features % _LANES or in_features % 2:
        return None
    library = this_library()
    if library is None or not hasattr(library, "grouped_linear_bf16"):
        return None
    weights = weights.detach().contiguous()
    packed = torch.empty(weights.numel(), dtype=torch.bfloat16)
    size = out_features * in_features
    for group in range(groups):  # at load, once per expert
        library.pack_linear_bf16(weights[group].data_ptr(), out_features, in_features,
                                 packed[group * size:].data_ptr())
    return GroupedLinear(library.grouped_linear_bf16, packed, groups, out_features, in_features)


def moe_combine(rows: torch.Tensor, where: torch.Tensor, weights: torch.Tensor, tokens: int) -> torch.Tensor | None:
    """out [tokens, dim] float32 = sum over j < k of weights[t * k + j] *
    rows[where[t * k + j]] (rows bfloat16 [N, dim]; where int64 [tokens * k],
    negative: skipped; weights float32 [tokens * k]) in one pass of
    kernels/moe.c; None where it is not built or dim is not a multiple of 16."""
    library = this_library()
    if library is None or not hasattr(library, "moe_combine_bf16") or rows.dtype != torch.bfloat16 \
            or rows.shape[1] % _LANES:
        return None
    k = where.numel() // max(tokens, 1)
    # The kernel reads rows[where]: bounds checked here, once.
    if where.dtype != torch.int64 or weights.dtype != torch.float32 or where.numel() != tokens * k \
            or weights.numel() != where.numel() or (where.numel() and int(where.max()) >= rows.shape[0]):
        raise ValueError("moe_combine takes int64 where and float32 weights, one per pair, within the rows")
    rows, where, weights = rows.contiguous(), where.contiguous(), weights.contiguous()
    out = torch.empty((tokens, rows.shape[1]), dtype=torch.float32)
    library.moe_combine_bf16(rows.data_ptr(), where.data_ptr(), weights.data_ptr(), out.data_ptr(), tokens, k,
                             rows.shape[1])
    return out
