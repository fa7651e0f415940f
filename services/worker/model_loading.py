"""Loading a model for the worker: an HF model's own modules as a step's
decoder, the generation config, the automatic KV budget, and handing freed
heap back to the OS after loading and long steps."""
from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig

from services.worker import attention
from services.worker.kv_cache import KVCacheSpec
from services.worker.platforms import Platform

log = logging.getLogger(__name__)

# input_ids [T] packed as the step lays them out, the step, the rows to return
# logits for -> logits [rows, vocab].
Decoder = Callable[[torch.Tensor, attention.PagedStep, torch.Tensor], torch.Tensor]


def hf_decoder(model: torch.nn.Module) -> Decoder:
    """Any other HF causal LM: its own modules, with paged attention plugged in."""

    def forward(input_ids: torch.Tensor, step: attention.PagedStep, logit_rows: torch.Tensor) -> torch.Tensor:
        output = model(
            input_ids=input_ids[None],
            position_ids=step.positions[None],
            use_cache=False,
            logits_to_keep=logit_rows,
            paged_step=step,
        )
        return output.logits[0]

    return forward


def return_freed_memory() -> None:
    """Hand freed heap back to the OS, which glibc would otherwise keep: after loading
    (float32 checkpoint tensors, the HF modules the lean path dropped: about 300 MB on
    the bundled model) and after long steps (prefills, decodes over long contexts),
    whose activations of up to 32 MB each land in per-thread heaps and stay resident
    once freed (about 440 MB more after 64 concurrent 1,000-token prompts)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def load_hf_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model through transformers, paged attention plugged in: other
    families, and checkpoints without safetensors files."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # device_map loads weights straight onto the device (no full CPU copy first).
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attention.register(), device_map=str(device)
    ).eval()


def generation_config(model_dir: Path, config) -> GenerationConfig:
    """generation_config.json, or what transformers derives from config.json without one."""
    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return GenerationConfig.from_model_config(config)


def auto_kv_budget(spec: KVCacheSpec, max_batch_size: int, max_seq_len: int, backend: Platform,
                   reserved: int = 0) -> int:
    """Room for `max_batch_size` sequences of `max_seq_len` tokens, so that no
    request within the configured limits is ever preempted, but no more than
    the backend's share of the memory available now, less `reserved` bytes
    (what the decode graphs will take)."""
    needed = max_batch_size * -(-max_seq_len // spec.block_size) * spec.bytes_per_block
    available = max(0, int(backend.available_memory() * backend.kv_memory_fraction) - reserved)
    budget = min(needed, available)
    log.info("KV budget: %.0f MiB (%d sequences of %d tokens need %.0f MiB; %.0f MiB may be taken)",
             budget / 2**20, max_batch_size, max_seq_len, needed / 2**20, available / 2**20)
    return budget
