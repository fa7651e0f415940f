"""Ascend NPU through torch_npu, written against the ops vllm-ascend calls
(torch_npu 2.x schemas); imported only where torch_npu is installed.

- KV write: npu_scatter_pa_kv_cache(key=, value=, key_cache=, value_cache=,
  slot_mapping=, cache_mode="Norm") into caches viewed as (num_blocks,
  block_size, kv_heads, head_dim); "Norm" because the op's default, PA_NZ,
  is a different (fractal) layout. cache_mode came with torch_npu 26.0.0
  (op-plugin's schema); before it the op writes PA_NZ only, so with an older
  torch_npu the K/V are written by slot in torch (index_copy_) instead.
- Attention, prefill chunks and decodes in one call:
  npu_fused_infer_attention_score with input_layout="TND" (query [T, heads,
  head_dim]), K/V as (num_blocks, block_size, kv_heads * head_dim) with the
  block table, actual_seq_lengths = each sequence's cumulative query end,
  actual_seq_lengths_kv = each context length, and sparse_mode=3 (causal,
  aligned to the bottom right of every sequence's [new, context] block) with
  the 2048 x 2048 int8 upper-triangular mask that mode takes. A sliding window
  is sparse_mode=4 (a band of pre_tokens before and next_tokens after). A
  step of one new token per sequence runs the op's decode branch, where
  sparse_mode, pre_tokens and next_tokens are documented as invalid (the
  band would be dropped): its windowed layers attend through attention.py's
  SDPA over the window instead.
  The fused paged path takes block sizes of 128 to 512, multiples of 128, and
  float16 / bfloat16; other pools attend through attention.py's SDPA path.
- npu_rms_norm, npu_swiglu (silu of the first half times the second), and
  npu_rotary_mul (rotate-half, 4-d inputs) for the lean decoder's layer ops.
- MLA (mla.py), as vllm-ascend's attention/mla_v1.py runs it: the latent's
  RMSNorm, the rope key's interleaved RoPE and both cache writes in one
  npu_kv_rmsnorm_rope_cache(cache_mode="PA") over the pool's latent and rope
  caches viewed (num_blocks, block_size, 1, 512 / 64); the query's RoPE by
  npu_interleave_rope; absorbed decode by npu_fused_infer_attention_score_v2
  with query_rope / key_rope, BNSD_NBSD, the latent as key and value. Those ops
  take DeepSeek-V3's 512 + 64 latent, float16 / bfloat16, 1 to 128 query heads
  (powers of two); other pools run mla.py's torch path. Prefill chunks attend
  through SDPA over the expanded K/V (torch ops on the device) there as here.
- Mixture-of-experts layers: npu_moe_gating_top_k for the router (DeepSeek's
  grouped sigmoid with its bias, and softmax top-k), then vllm-ascend's chain:
  npu_moe_init_routing_v2, npu_grouped_matmul, npu_swiglu,
  npu_grouped_matmul, npu_moe_token_unpermute (NpuExperts).
- Decode steps as graphs (npu_graphs.py): torch.npu.NPUGraph, captured with
  auto_dispatch_capture, the fused op's context lengths updated before each
  replay. A captured step's inputs are views of the persistent buffers
  (NpuAttention.graph_inputs); its windowed decodes attend through SDPA over
  the last `window` positions of each context, laid out by device ops.
- torch.npu.set_device / synchronize / mem_get_info; HCCL collectives.

Never run on an NPU in this repository: tests/fake_npu holds a torch_npu whose
ops are reference implementations on CPU with these signatures and layouts,
and the bundled model must give the CPU platform's logits through this file.
"""
from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from typing import ClassVar

import torch

from services.worker.attention import DecodeBatch, StepSequences, decode_batch, decode_sdpa, write_kv_by_slot
from services.worker.graphs import GraphBuffers
from services.worker.kv_cache import KVCacheSpec
from services.worker.platforms.base import Linear, Platform
from services.worker.platforms.moe_ops import RENORM_EPS, MoeRouting
from services.worker.platforms.npu_graphs import NpuGraphCapture
from services.worker.platforms.npu_moe import NpuExperts, gating_fits
from services.worker.platforms.npu_quant import quantized_linear
from services.worker.quantization import QuantizedWeight

log = logging.getLogger(__name__)

# sparse_mode 3/4 take this compressed causal mask, whatever the sequence lengths.
MASK_SIZE = 2048
FUSED_BLOCK_SIZES = range(128, 513, 128)
FUSED_DTYPES = (torch.float16, torch.bfloat16)
CAUSAL, BAND = 3, 4
# What the fused MLA ops take: (kv_lora_rank, rope_dim), and query heads per rank.
MLA_LATENT = (512, 64)
MLA_QUERY_HEADS = (1, 2, 4, 8, 16, 32, 64, 128)


def import_torch_npu():
    """torch_npu registers the "npu" device (torch.npu) on import."""
    return importlib.import_module("torch_npu")


def npu_available() -> bool:
    try:
        import_torch_npu()
    except ImportError:
        return False
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def takes_cache_mode(scatter_op) -> bool:
    """Whether npu_scatter_pa_kv_cache (torch.ops.npu's, with its schema) has cache_mode."""
    return any(argument.name == "cache_mode" for argument in scatter_op.default._schema.arguments)


@dataclass
class NpuStepInputs:
    """One step's inputs to the fused op: prepared from the host's
    StepSequences for an eager step, or views of the persistent GraphBuffers
    for a captured one (NpuAttention.graph_inputs)."""

    block_table: torch.Tensor  # [S, max_blocks] int32 on the device
    actual_seq_lengths: list[int]  # cumulative query ends, TND's convention
    # Each sequence's context, new tokens included. A captured step's is a
    # placeholder: the graph bakes host values in, and NpuGraph.replay
    # refreshes the captured ops' copies before each replay.
    actual_seq_lengths_kv: list[int]
    decode_only: bool  # one new token per sequence: the op's decode branch
    block_size: int
    device: torch.device
    sequences: StepSequences | None  # on the host; None in a captured step
    seq_lens: torch.Tensor | None = None  # [S] int32 on the device: a captured step's context lengths

    @functools.cached_property
    def decode(self) -> DecodeBatch:
        """An eager decode-only step as attention.py's SDPA path lays it out,
        built once per step where a windowed layer needs it."""
        s = self.sequences
        assert s is not None, "a captured step lays out its windowed decodes with window_decode"
        return decode_batch(s.block_tables, s.starts, s.context_lens, self.block_size, self.device)

    def window_decode(self, window: int) -> DecodeBatch:
        """A decode-only step's layout for a layer attending over `window`
        keys: the eager step's (decode); in a captured step, made by device
        ops from the buffers each time (the graph replays them) over the last
        `window` positions of each context (at most what a block table
        holds), so no value is read on the host and every shape is fixed."""
        if self.sequences is not None:
            return self.decode
        assert self.seq_lens is not None
        span = min(window, self.block_table.shape[1] * self.block_size)
        lengths = self.seq_lens.long()
        positions = lengths[:, None] - span + torch.arange(span, device=self.device)[None, :]  # [S, span]
        valid = positions >= 0
        positions = positions.clamp(min=0)  # masked keys read position 0, which was written
        blocks = torch.gather(self.block_table, 1, positions // self.block_size).long()
        return DecodeBatch(
            rows=torch.arange(lengths.shape[0], device=self.device),
            context_slots=blocks * self.block_size + positions % self.block_size,
            key_positions=positions,
            query_positions=(lengths - 1)[:, None],
            mask=valid[:, None, None, :],
        )


class NpuAttention:
    def __init__(self, torch_npu, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device, scatter_cache_mode: bool):
        """`scatter_cache_mode`: whether this torch_npu's npu_scatter_pa_kv_cache
        takes cache_mode (takes_cache_mode); without it K/V are written by slot."""
        self._npu = torch_npu
        self._num_heads, self._num_kv_heads, self._head_dim = num_heads, num_kv_heads, head_dim
        self._block_size = block_size
        self._scatter = scatter_cache_mode
        # 1 = masked: the strict upper triangle.
        self._mask = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.int8, device=device), diagonal=1)

    def prepare(self, sequences: StepSequences, device: torch.device) -> NpuStepInputs:
        return NpuStepInputs(
            block_table=sequences.block_tables.to(device=device, dtype=torch.int32),
            actual_seq_lengths=torch.cumsum(sequences.num_new, 0).tolist(),
            actual_seq_lengths_kv=sequences.context_lens.tolist(),
            decode_only=int(sequences.num_new.max()) == 1,
            block_size=self._block_size,
            device=device,
            sequences=sequences,
        )

    def graph_inputs(self, buffers: GraphBuffers) -> NpuStepInputs:
        """A captured decode step's inputs: the buffers' block table itself,
        the query ends fixed by the captured size, and context lengths that
        stand in until NpuGraph.replay updates the captured ops with the
        step's (each sequence's new rows, a length the op takes)."""
        num_seqs, rows = buffers.num_seqs, buffers.rows_per_seq
        return NpuStepInputs(
            block_table=buffers.block_table,
            actual_seq_lengths=[rows * (i + 1) for i in range(num_seqs)],
            actual_seq_lengths_kv=[rows] * num_seqs,
            decode_only=rows == 1,
            block_size=self._block_size,
            device=buffers.block_table.device,
            sequences=None,
            seq_lens=buffers.seq_lens,
        )

    def _blocks(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, self._block_size, self._num_kv_heads, self._head_dim)

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not self._scatter:
            write_kv_by_slot(key_cache, value_cache, key, value, slot_mapping)
            return
        self._npu.npu_scatter_pa_kv_cache(
            key=key.contiguous(), value=value.contiguous(),
            key_cache=self._blocks(key_cache), value_cache=self._blocks(value_cache),
            slot_mapping=slot_mapping.to(torch.int32), cache_mode="Norm",
        )

    def __call__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 inputs: NpuStepInputs, block_size: int, scale: float, sliding_window: int | None) -> torch.Tensor:
        if sliding_window is not None and inputs.decode_only:  # the decode branch would drop the band
            return decode_sdpa(query, key_cache, value_cache, inputs.window_decode(sliding_window), scale,
                               sliding_window)
        band = {} if sliding_window is None else {
            "sparse_mode": BAND, "pre_tokens": sliding_window - 1, "next_tokens": 0}
        out, _ = self._npu.npu_fused_infer_attention_score(
            query.contiguous(),
            key_cache.view(-1, block_size, self._num_kv_heads * self._head_dim),
            value_cache.view(-1, block_size, self._num_kv_heads * self._head_dim),
            atten_mask=self._mask,
            block_table=inputs.block_table,
            input_layout="TND",
            block_size=block_size,
            actual_seq_lengths=inputs.actual_seq_lengths,
            actual_seq_lengths_kv=inputs.actual_seq_lengths_kv,
            num_heads=self._num_heads,
            num_key_value_heads=self._num_kv_heads,
            scale=scale,
            **({"sparse_mode": CAUSAL} | band),
        )
        return out


class NpuLayerOps:
    def __init__(self, torch_npu):
        self._npu = torch_npu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._npu.npu_rms_norm(x, weight, epsilon=eps)[0]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._npu.npu_swiglu(gate_up, dim=-1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, head_dim] as one BSND batch; cos, sin [rows, head_dim]."""
        return self._npu.npu_rotary_mul(x.contiguous()[None], cos[None, :, None, :], sin[None, :, None, :])[0]


class NpuMlaOps:
    """mla.MlaOps on Ascend's fused MLA ops (the module docstring); one for every
    MLA layer of a model, so that a step's block tables are made once."""

    def __init__(self, torch_npu, block_size: int):
        self._npu = torch_npu
        self._block_size = block_size
        self._decode_of: DecodeBatch | None = None  # the step whose decode inputs are held
        self._decode_inputs: tuple[torch.Tensor, list[int]] = (torch.empty(0), [])

    def write_latent(self, kv: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                     sin: torch.Tensor, latent_cache: torch.Tensor, rope_cache: torch.Tensor,
                     slot_mapping: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows, rank, rope_dim = kv.shape[0], latent_cache.shape[-1], rope_cache.shape[-1]
        # Each token a batch row of one: the op's [B, N, S, D] with N = S = 1.
        _, _, k_pe, c_kv = self._npu.npu_kv_rmsnorm_rope_cache(
            kv.contiguous().view(rows, 1, 1, -1), norm_weight, cos.reshape(rows, 1, 1, -1),
            sin.reshape(rows, 1, 1, -1), slot_mapping.to(torch.int64),
            rope_cache.view(-1, self._block_size, 1, rope_dim), latent_cache.view(-1, self._block_size, 1, rank),
            epsilon=eps, cache_mode="PA", is_output_kv=True,
        )
        return c_kv.view(rows, rank), k_pe.view(rows, rope_dim)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, heads, rope_dim] as the op's [B, N, S, D] with S = 1."""
        rows = x.shape[0]
        return self._npu.npu_interleave_rope(x.contiguous()[:, :, None, :], cos.reshape(rows, 1, 1, -1),
                                             sin.reshape(rows, 1, 1, -1))[:, :, 0]

    def _block_tables(self, decode: DecodeBatch) -> tuple[torch.Tensor, list[int]]:
        """The decodes' block tables [B, max_blocks] int32, read off the first slot
        of each block of the gathered layout, and context lengths: made by a
        step's first layer, reused by the others (one host sync per step)."""
        if self._decode_of is not decode:
            tables = (decode.context_slots[:, :: self._block_size] // self._block_size).to(torch.int32)
            self._decode_of = decode
            self._decode_inputs = (tables, (decode.query_positions[:, 0] + 1).tolist())
        return self._decode_inputs

    def decode(self, q_latent: torch.Tensor, q_rope: torch.Tensor, latent_cache: torch.Tensor,
               rope_cache: torch.Tensor, decode: DecodeBatch, scale: float) -> torch.Tensor:
        """Returns [heads, B, kv_lora_rank], the op's NBSD output."""
        num_heads, rank, rope_dim = q_latent.shape[1], latent_cache.shape[-1], rope_cache.shape[-1]
        block_table, context_lens = self._block_tables(decode)
        latent = latent_cache.view(-1, 1, self._block_size, rank)  # (blocks, KV_N = 1, block_size, D)
        out, _ = self._npu.npu_fused_infer_attention_score_v2(
            q_latent.contiguous()[:, :, None, :], latent, latent,
            query_rope=q_rope.contiguous()[:, :, None, :],
            key_rope=rope_cache.view(-1, 1, self._block_size, rope_dim),
            num_query_heads=num_heads, num_key_value_heads=1, input_layout="BNSD_NBSD", softmax_scale=scale,
            block_table=block_table, block_size=self._block_size, actual_seq_kvlen=context_lens,
        )
        return out[:, :, 0]


class NpuPlatform(Platform):
    name: ClassVar[str] = "npu"
    dist_backend: ClassVar[str] = "hccl"

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._npu = import_torch_npu()
        self._scatter_cache_mode = takes_cache_mode(torch.ops.npu.npu_scatter_pa_kv_cache)
        if not self._scatter_cache_mode:
            log.warning("torch_npu's npu_scatter_pa_kv_cache has no cache_mode (torch_npu before 26.0.0) and "
                        "writes the PA_NZ layout only: K/V are written by slot in torch")

    def synchronize(self) -> None:
        torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def available_memory(self) -> int:
        return torch.npu.mem_get_info(self.device)[0]  # type: ignore[attr-defined]

    def set_device(self, local_rank: int) -> None:
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]

    def graph_capture(self) -> NpuGraphCapture:
        return NpuGraphCapture(self.device)

    def linear(self, weight: torch.Tensor | QuantizedWeight, bias: torch.Tensor | None) -> Linear:
        """A quantized weight on the Ascend quantized matmuls (npu_quant.py), as it is stored."""
        if not isinstance(weight, torch.Tensor):
            quantized = quantized_linear(self._npu, weight, bias, self.device)
            if quantized is not None:
                return quantized
        return super().linear(weight, bias)

    def layer_ops(self, dtype: torch.dtype, hidden_size: int, intermediate_size: int, head_dim: int) -> NpuLayerOps:
        return NpuLayerOps(self._npu)

    def paged_attention(self, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                        block_size: int) -> NpuAttention | None:
        if block_size not in FUSED_BLOCK_SIZES or dtype not in FUSED_DTYPES:
            log.warning("the fused NPU attention takes %s pools with blocks of 128 to 512 tokens (multiples of "
                        "128); %s with %d-token blocks attends through SDPA", FUSED_DTYPES, dtype, block_size)
            return None
        return NpuAttention(self._npu, num_heads, num_kv_heads, head_dim, block_size, self.device,
                            self._scatter_cache_mode)

    def moe_select(self, logits: torch.Tensor, routing: MoeRouting) -> tuple[torch.Tensor, torch.Tensor]:
        """npu_moe_gating_top_k where it takes the routing (gating_fits), on float32
        logits as transformers scores them; otherwise the torch reference."""
        if not gating_fits(logits.shape[-1], routing):
            return super().moe_select(logits, routing)
        sigmoid = routing.scoring == "sigmoid"
        weights, ids, _ = self._npu.npu_moe_gating_top_k(
            logits.float(), k=routing.top_k, bias=None if routing.bias is None else routing.bias.float(),
            k_group=routing.topk_groups, group_count=routing.num_groups, group_select_mode=1,  # groups by top-2 sum
            renorm=0, norm_type=1 if sigmoid else 0, routed_scaling_factor=routing.scaling_factor if sigmoid else 1.0,
            eps=RENORM_EPS)
        if not sigmoid:  # the op renormalises sigmoid scores only; softmax ones as vllm-ascend does, after it
            if routing.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = weights * routing.scaling_factor if routing.scaling_factor != 1.0 else weights
        return weights, ids

    def moe_experts(self, gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0,
                    num_experts: int | None = None) -> NpuExperts:
        return NpuExperts(self._npu, gate_up, down, first_expert, num_experts)

    def mla_ops(self, spec: KVCacheSpec, num_heads: int) -> NpuMlaOps | None:
        latent = spec.latent
        fits = (latent is not None and (latent.kv_lora_rank, latent.rope_dim) == MLA_LATENT
                and spec.dtype in FUSED_DTYPES and spec.block_size in FUSED_BLOCK_SIZES
                and num_heads in MLA_QUERY_HEADS)
        if not fits:
            log.warning("Ascend's fused MLA ops take a %s latent in %s pools of 128 to 512-token blocks and up to "
                        "128 query heads (powers of two); MLA runs in torch ops", MLA_LATENT, FUSED_DTYPES)
            return None
        return NpuMlaOps(self._npu, spec.block_size)
