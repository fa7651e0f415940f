"""The CUDA platform's Triton attention and KV write (platforms/triton_attention.py)
on CPU: the kernels run through Triton's interpreter (chosen for CPU tensors,
whatever TRITON_INTERPRET says) and are held to attention.py's SDPA path, the
oracle; the launches are checked to read nothing back to the host, and are
compiled for sm_80 and sm_90 (ptxas ships with Triton: no GPU needed). The
interpreter has no bfloat16 dot: bfloat16 runs on a GPU only (tests/gpu)."""
from __future__ import annotations

import sys

import pytest
import torch

from services.worker import attention
from services.worker.graphs import GraphBuffers
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.platforms.cuda import CudaPlatform
from tests.unit.worker.paged_oracle import assert_matches_sdpa

triton_attention = pytest.importorskip("services.worker.platforms.triton_attention")
TritonAttention, TritonInputs = triton_attention.TritonAttention, triton_attention.TritonInputs

CPU = torch.device("cpu")
META = torch.device("meta")
# The kernel's own rounding in float16 against the float32 oracle (P and the
# output rounded to float16), as tests/gpu allows it: measured 8e-4 at most
# here, as much as the SDPA path's own in float16; a misplaced key or mask
# moves outputs by 0.1 and more.
FLOAT16_TOLERANCE = 1.5e-3


def kernel(heads: int, kv_heads: int, head_dim: int, block_size: int, dtype=torch.float32) -> TritonAttention:
    """The platform's own choice for this pool (CudaPlatform touches no device here)."""
    chosen = CudaPlatform(torch.device("cuda")).paged_attention(dtype, heads, kv_heads, head_dim, block_size)
    assert isinstance(chosen, TritonAttention)
    return chosen


# (new, computed) per sequence, block size B: decodes of a fresh sequence, at a
# block's last slot (context B), past the boundary (B + 1) and deep in (2B + 7).
def decodes(b: int) -> tuple[list[int], list[int]]:
    return [1, 1, 1, 1], [0, b - 1, b, 2 * b + 7]


STEPS = {
    "decodes": decodes,
    "fresh prompt": lambda b: ([21], [0]),
    "chunks over a cached prefix": lambda b: ([19, 7], [30, b]),
    "drafted rows": lambda b: ([5, 3], [b + 3, b - 2]),  # a decode plus drafts, several rows after a cache
    "mixed": lambda b: ([1, 5, 21, 19, 1], [b - 1, 40, 0, 30, 2 * b]),
}


@pytest.mark.parametrize("step", list(STEPS))
def test_each_kind_of_step_matches_sdpa(step):
    """4 query heads over 2 KV heads, 16-token blocks, causal."""
    torch.manual_seed(1)
    new, computed = STEPS[step](16)
    assert_matches_sdpa(kernel(4, 2, 64, 16), 4, 2, 64, 16, 24, new=new, computed=computed, window=None)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"),
                         [(4, 4, 64, 16), (4, 1, 64, 32), (6, 2, 40, 48), (2, 1, 80, 16)],
                         ids=["mha", "4-per-kv-block32", "3-per-kv-dim40-block48", "dim80"])
@pytest.mark.parametrize("window", [None, 5, 40], ids=["causal", "window5", "window40"])
def test_heads_blocks_and_windows_match_sdpa(heads, kv_heads, head_dim, block_size, window):
    """Grouped heads (3 per KV head leaves rows of the program's 16 unused),
    head_dim padded to a power of two, a block size that is not one, windows
    shorter than a tile and spanning blocks, over the mixed step."""
    torch.manual_seed(heads + head_dim + block_size)
    new, computed = STEPS["mixed"](block_size)
    assert_matches_sdpa(kernel(heads, kv_heads, head_dim, block_size), heads, kv_heads, head_dim, block_size, 24,
                        new=new, computed=computed, window=window)


@pytest.mark.parametrize("window", [None, 7], ids=["causal", "window7"])
def test_float16_matches_the_float32_oracle(window):
    torch.manual_seed(3)
    new, computed = STEPS["mixed"](16)
    assert_matches_sdpa(kernel(4, 2, 64, 16, torch.float16), 4, 2, 64, 16, 24, new=new, computed=computed,
                        window=window, dtype=torch.float16, tolerance=FLOAT16_TOLERANCE)


def test_write_kv_puts_each_row_at_its_slot():
    """Rows from a strided view (the HF path hands K/V over transposed), slots
    scattered; a negative slot writes nothing."""
    torch.manual_seed(4)
    kv_heads, head_dim, num_slots = 3, 40, 64
    caches = [torch.randn(num_slots, kv_heads, head_dim) for _ in range(2)]
    expected = [c.clone() for c in caches]
    key, value = (torch.randn(1, kv_heads, 6, head_dim)[0].transpose(0, 1) for _ in range(2))
    slots = torch.tensor([17, 3, 60, -1, 32, 0])
    kernel(6, kv_heads, head_dim, 16).write_kv(caches[0], caches[1], key, value, slots)
    written = slots >= 0
    attention.write_kv_by_slot(expected[0], expected[1], key[written], value[written], slots[written])
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


class RecordedLaunch:
    """Stands in for a Triton kernel: records `kernel[grid](*args, **kwargs)`."""

    def __init__(self, fn):
        self.fn, self.launches = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.fixture
def recorded(monkeypatch):
    """(attention, KV write) launches of the compiled kernels, recorded, not run."""
    attend, write = triton_attention._kernels(False)
    launches = RecordedLaunch(attend), RecordedLaunch(write)
    monkeypatch.setattr(triton_attention, "kernels_for", lambda device: launches)
    return launches


def meta_step(kernel: TritonAttention, dtype: torch.dtype, num_seqs: int, rows_per_seq: int, window: int | None):
    """Attention and KV write of a step on the meta device: tensors with shapes
    and no values, so any value read back to the host raises."""
    rows, kv_heads, dim = num_seqs * rows_per_seq, kernel.num_kv_heads, kernel.head_dim
    inputs = TritonInputs(torch.empty(num_seqs + 1, dtype=torch.int32, device=META),
                          torch.empty(num_seqs, dtype=torch.int32, device=META),
                          torch.empty(num_seqs, 64, dtype=torch.int32, device=META), rows_per_seq)
    cache = torch.empty(4096, kv_heads, dim, dtype=dtype, device=META)
    kernel.write_kv(cache, cache, *(torch.empty(rows, kv_heads, dim, dtype=dtype, device=META) for _ in range(2)),
                    torch.empty(rows, dtype=torch.int64, device=META))
    out = kernel(torch.empty(rows, kernel.num_heads, dim, dtype=dtype, device=META), cache, cache, inputs,
                 kernel.block_size, dim ** -0.5, window)
    return inputs, out


def test_launches_read_nothing_back_to_the_host(recorded):
    """What a CUDA graph captures: the grid from shapes alone (T // BLOCK_Q + S
    query blocks, one program column per KV head), lengths and tables handed
    over as the device tensors they are."""
    attend, write = recorded
    triton_kernel = kernel(12, 4, 64, 16, torch.bfloat16)  # 3 heads per KV head: BLOCK_Q = 16 // 3 = 5
    inputs, out = meta_step(triton_kernel, torch.bfloat16, num_seqs=7, rows_per_seq=4, window=None)
    assert out.shape == (28, 12, 64) and out.device == META
    (grid, args, kwargs), = attend.launches
    assert grid == (28 // 5 + 7, 4)
    assert any(a is inputs.seq_lens for a in args) and any(a is inputs.query_start for a in args)
    assert any(a is inputs.block_table for a in args)
    assert [launch[0] for launch in write.launches] == [(28,)]


def test_graph_inputs_are_the_buffers_and_are_read_at_each_launch():
    """graph_inputs wraps the persistent buffers (no copies); a launch over them
    reads whatever step was copied in last, as a graph replay does."""
    torch.manual_seed(5)
    heads, kv_heads, dim, block_size, num_seqs, rows_per_seq = 4, 2, 64, 16, 3, 2
    triton_kernel = kernel(heads, kv_heads, dim, block_size)
    rows = num_seqs * rows_per_seq
    buffers = GraphBuffers(num_seqs, rows_per_seq, torch.zeros(rows, dtype=torch.long),
                           torch.zeros(rows, dtype=torch.long), torch.zeros(rows, dtype=torch.long),
                           torch.zeros(num_seqs, 4, dtype=torch.int32), torch.zeros(num_seqs, dtype=torch.int32),
                           torch.arange(num_seqs + 1, dtype=torch.int32) * rows_per_seq)
    inputs = triton_kernel.graph_inputs(buffers)
    assert inputs.seq_lens is buffers.seq_lens and inputs.block_table is buffers.block_table
    assert inputs.query_start is buffers.query_start and inputs.max_query_len == rows_per_seq
    key_cache, value_cache = torch.randn(2, 12 * block_size, kv_heads, dim)
    for computed, tables in (([5, 16, 30], [[3], [7, 2], [0, 9]]), ([14, 40, 1], [[4], [1, 5, 8], [6]])):
        buffers.seq_lens.copy_(torch.tensor(computed) + rows_per_seq)
        for i, table in enumerate(tables):
            buffers.block_table[i, : len(table)] = torch.tensor(table)
        query = torch.randn(rows, heads, dim)
        out = triton_kernel(query, key_cache, value_cache, inputs, block_size, dim ** -0.5, None)
        pool = KVCachePool(KVCacheSpec(1, kv_heads, dim, block_size, torch.float32), 12, CPU)
        pool.key_cache[0], pool.value_cache[0] = key_cache, value_cache
        step = attention.build_paged_step(pool, [rows_per_seq] * num_seqs, computed, tables, CPU)
        # The oracle writes the step's K/V before it attends: hand it what the cache holds.
        k, v = key_cache[step.slot_mapping], value_cache[step.slot_mapping]
        oracle = attention.paged_attention(query, k, v, 0, step, None, None)
        torch.testing.assert_close(out, oracle, atol=2e-6, rtol=2e-6)


def test_the_kernels_compile_for_sm80_and_sm90(recorded, tmp_path, monkeypatch):
    """What the recorded launches would compile, in each dtype, through ptxas:
    the interpreter checks no compiled-only rule (tl.dot's shapes and dtypes,
    loop-carried types, the interpreter-only branch left out)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime import JITFunction

    if not isinstance(triton.language.standard._sum_combine, JITFunction):
        pytest.skip("triton was imported under TRITON_INTERPRET=1: its library cannot compile in this process")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    cases = [(torch.bfloat16, 90, 1, None, (32, 8, 128)), (torch.float16, 80, 7, 4096, (9, 3, 80)),
             (torch.float32, 90, 3, None, (4, 4, 64))]
    pointers = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32",
                torch.int64: "*i64"}
    for dtype, arch, rows_per_seq, window, (heads, kv_heads, dim) in cases:
        for launches in recorded:
            launches.launches.clear()
        meta_step(TritonAttention(heads, kv_heads, dim, 16), dtype, 4, rows_per_seq, window)
        for launches in recorded:
            (_, args, kwargs), = launches.launches
            values = dict(zip(launches.fn.arg_names, args)) | kwargs
            signature, constexprs = {}, {}
            for param in launches.fn.params:
                value = values[param.name]
                if param.is_constexpr:
                    signature[param.name], constexprs[param.name] = "constexpr", value
                elif isinstance(value, torch.Tensor):
                    signature[param.name] = pointers[value.dtype]
                else:
                    signature[param.name] = "fp32" if isinstance(value, float) else "i32"
            compiled = triton.compile(ASTSource(launches.fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))
            assert compiled.asm["cubin"]


def test_the_platform_attends_through_sdpa_where_the_kernel_does_not_fit(monkeypatch):
    cuda = CudaPlatform(torch.device("cuda"))
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        for block_size in (16, 32, 48, 256):
            assert isinstance(cuda.paged_attention(dtype, 8, 2, 64, block_size), TritonAttention)
    assert cuda.paged_attention(torch.bfloat16, 8, 2, 64, 8) is None
    assert cuda.paged_attention(torch.bfloat16, 8, 2, 64, 24) is None
    assert cuda.paged_attention(torch.float64, 8, 2, 64, 16) is None
    # A machine without Triton.
    monkeypatch.delitem(sys.modules, "services.worker.platforms.triton_attention")
    monkeypatch.setitem(sys.modules, "triton", None)
    assert cuda.paged_attention(torch.bfloat16, 8, 2, 64, 16) is None
