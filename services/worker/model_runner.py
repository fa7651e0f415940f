"""Runs the model one step at a time over the paged KV cache.

A step: release finished sequences, check the batch against what the worker
holds (admission.py: a sequence it cannot serve is left out and reported, a
step that contradicts its state is refused whole), pack every sequence's new
tokens into one row, run the HF model once (logits only for the last token of
each sampling sequence), sample on the device (sequence_state.py: what each
sequence keeps between steps, and the sampling over it), and commit the new
cache lengths.

The scheduler owns the KV blocks: every input carries its block table, and the
worker reads and writes the pool only through it (it allocates nothing itself).

Not thread-safe by design: the server calls `step` from one worker thread.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from services.common.errors import invalid_argument
from services.common.media_parts import has_vision_tower
from services.worker import attention, quant_formats, quantization, speculative
from services.worker.admission import StepAdmission
from services.worker.platforms import Platform, torch_dtype
from services.worker.checkpoint import Checkpoint
from services.worker.decoder import SUPPORTED_MODEL_TYPES, LeanDecoder
from services.worker.graphs import GraphCapture, StepGraphs
from services.worker.guided import GuidedDecoding
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.model_loading import (
    Decoder, auto_kv_budget, generation_config, hf_decoder, load_hf_model, return_freed_memory)
from services.worker.mtp import MtpDrafter, check_mtp
from services.worker.parallel import TensorParallel
from services.worker.sequence import (
    Refusal, SampledToken, SamplingParams, SequenceInput, SequenceRefused, StepResult, decode_by_id)
from services.worker.sequence_state import SequenceSampling, SequenceState
from services.worker.vision import VisionLanguageDecoder

log = logging.getLogger(__name__)

# A seq_id the scheduler will not use, for the start-up warm-up step.
WARM_UP_SEQ_ID = 2**64 - 1


@dataclass(frozen=True)
class SamplingDefaults:
    """The model's own sampling defaults; None where generation_config sets none."""

    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None


@dataclass(frozen=True)
class ModelDescription:
    model_path: str
    vocab_size: int
    eos_token_ids: list[int]
    max_position_embeddings: int  # 0 = the config does not say
    device: str
    dtype: str
    num_kv_blocks: int
    block_size: int
    max_batch_size: int
    sampling_defaults: SamplingDefaults
    max_decode_steps: int = 1  # StepRequest.decode_steps


# The most steps one request may ask of its decodes by id (StepRequest.decode_steps):
# far above what a scheduler needs to keep up (a few), low enough that a step
# stream never runs for long on one request.
MAX_DECODE_STEPS = 64


# After a step that ran at least this long (a prefill, decodes over long contexts),
# the heap its activations freed goes back to the OS (return_freed_memory): the
# trim's 1 to 15 ms are then a few percent of the step at most.
_TRIM_AFTER_SECONDS = 0.1


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class ModelRunner(StepAdmission, SequenceSampling):
    def __init__(
        self,
        model_dir: Path,
        backend: Platform,
        dtype: str,
        block_size: int,
        kv_cache_bytes: int,
        max_batch_size: int,
        max_seq_len: int = 2560,
        tensor_parallel: TensorParallel | None = None,
        mtp: bool = False,
        graph_capture: GraphCapture | None = None,
    ):
        """`kv_cache_bytes` 0: an automatic budget (auto_kv_budget); per rank of
        `tensor_parallel`, the group this runner is one rank of (parallel.py).
        `mtp`: draft with the checkpoint's multi-token prediction module (mtp.py).
        `graph_capture`: replay decode steps from graphs made by it (graphs.py)
        where the model allows; None runs every step eagerly."""
        self.model_dir = model_dir
        self.backend = backend
        self.dtype_name = dtype
        self.max_batch_size = max_batch_size
        dtype_t = torch_dtype(dtype)
        started = time.monotonic()
        self.config = AutoConfig.from_pretrained(model_dir)
        text_config = self.config.get_text_config()
        architecture = (getattr(self.config, "architectures", None) or [self.config.model_type])[0]
        lean = LeanDecoder.supports(self.config)
        # A quantized checkpoint is read by quantization.py on the lean path only:
        # transformers would cast msModelSlim's integers to floats without a word.
        quantized = quant_formats.describe(model_dir)
        if quantized is not None and (not lean or not Checkpoint.available(model_dir)
                                      or has_vision_tower(self.config)):
            raise quantization.UnsupportedQuantization(
                f"{architecture} as a {quantized} checkpoint is not served: quantized checkpoints are read for "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} models in safetensors files")
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        if tensor_parallel is not None:  # this rank's heads (ValueError with fewer KV heads than ranks)
            if has_vision_tower(self.config):
                raise ValueError(f"tensor parallelism does not split vision-language models ({architecture})")
            shard = tensor_parallel.head_shard(num_heads, num_kv_heads)
            num_heads, num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.tensor_parallel = tensor_parallel
        # The pool's layout, before any weight is read: a model whose cache cannot be
        # laid out (an MLA family other than DeepSeek-V3's) is refused now, by name.
        spec = KVCacheSpec.from_model_config(self.config, block_size, dtype_t)
        if spec.latent is None:  # per rank of a group: its KV heads' share of the pool
            spec = dataclasses.replace(spec, num_kv_heads=num_kv_heads)
        if mtp:
            check_mtp(text_config, lean, tensor_parallel)
            spec = dataclasses.replace(spec, num_layers=spec.num_layers + 1)  # the module's own KV
        with torch.inference_mode():
            if has_vision_tower(self.config):
                self.decoder: Decoder | VisionLanguageDecoder = VisionLanguageDecoder(
                    self.config, model_dir, dtype_t, backend)
            elif lean and Checkpoint.available(model_dir):
                self.decoder = LeanDecoder(self.config, Checkpoint(model_dir, dtype_t, backend.device), backend,
                                           tensor_parallel, spec, mtp)
            elif lean:  # a checkpoint without safetensors files
                model = load_hf_model(model_dir, dtype_t, backend.device)
                self.decoder = LeanDecoder(self.config, model.state_dict(), backend, tensor_parallel, spec, mtp)
                del model  # the lean decoder holds every weight it needs; the HF modules go
            elif tensor_parallel is not None:  # the whole model on the host, this rank's shard on its device
                model = load_hf_model(model_dir, dtype_t, torch.device("cpu"))
                tensor_parallel.shard_module(model, text_config)
                self.decoder = hf_decoder(model.to(backend.device))
            else:
                self.decoder = hf_decoder(load_hf_model(model_dir, dtype_t, backend.device))
        self.generation_config = generation_config(model_dir, self.config)
        self.vocab_size: int = int(text_config.vocab_size)
        self.max_position_embeddings: int = getattr(text_config, "max_position_embeddings", None) or 0
        return_freed_memory()  # conversion copies, before the pool takes its share
        # MLA reads the latent pool itself (mla.py): no per-head attention kernel.
        self.attention_kernel = None if spec.latent is not None else backend.paged_attention(
            dtype_t, num_heads, num_kv_heads, spec.head_dim, block_size)
        if self.max_position_embeddings:
            max_seq_len = min(max_seq_len, self.max_position_embeddings)
        graphs_off = "off: none asked for" if graph_capture is None else self._graphs_refused(spec, mtp)
        with torch.inference_mode():
            if kv_cache_bytes == 0:
                graph_memory = 0
                if not graphs_off:  # counted before the pool takes its share
                    try:
                        graph_memory = self._new_graphs(graph_capture, KVCachePool(spec, 1, backend.device, 1),
                                                        max_seq_len).measure()
                    except Exception as exc:  # noqa: BLE001 - the worker serves all the same, eagerly
                        log.exception("capturing a decode-step graph failed")
                        graphs_off = f"off: capture failed ({exc})"
                        graph_capture.empty_cache()
                kv_cache_bytes = auto_kv_budget(spec, max_batch_size, max_seq_len, backend, graph_memory)
            num_blocks = spec.num_blocks_for(kv_cache_bytes)
            if tensor_parallel is not None:  # one block id means the same tokens on every rank
                num_blocks = tensor_parallel.min_over_ranks(num_blocks)
            self.kv_pool = KVCachePool(spec, num_blocks, backend.device, reserved_blocks=0 if graphs_off else 1)
            self.graphs = None if graphs_off else self._capture_graphs(graph_capture, max_seq_len)
        if self.graphs is None:
            log.info("decode steps run eagerly (graphs %s)", graphs_off or "failed to capture")
        self.mtp = MtpDrafter(self.decoder, self.kv_pool, backend.device) if mtp else None
        self.block_size = block_size
        self.sequences: dict[int, SequenceState] = {}
        self._guided: GuidedDecoding | None = None  # built on the first grammar request
        log.info(
            "loaded %s (%s, %s%s, %s path, attention on %s) in %.2f s",
            model_dir.name, architecture, dtype, "" if quantized is None else f", {quantized} weights",
            "lean" if isinstance(self.decoder, LeanDecoder) else "HF modules",
            "the native kernel" if self.attention_kernel else "SDPA", time.monotonic() - started,
        )

    def _graphs_refused(self, spec: KVCacheSpec, mtp: bool) -> str:
        """Why this model's decode steps cannot replay from graphs; "" when they can."""
        if not isinstance(self.decoder, LeanDecoder):
            return "off: the model runs through the HF modules"
        if self.tensor_parallel is not None or mtp:
            return "off: not under tensor parallelism or MTP drafting"
        if spec.latent is not None:
            return "off: MLA layers are not captured"
        if self.attention_kernel is None:
            return "off: attention runs through SDPA, whose shapes change with the contexts"
        return ""

    def _new_graphs(self, capture: GraphCapture, pool: KVCachePool, max_seq_len: int) -> StepGraphs:
        return StepGraphs(capture, self.decoder, pool, self.attention_kernel, self.max_batch_size,
                          -(-max_seq_len // pool.spec.block_size), self.backend.device)

    def _capture_graphs(self, capture: GraphCapture, max_seq_len: int) -> StepGraphs | None:
        graphs = self._new_graphs(capture, self.kv_pool, max_seq_len)
        started, before = time.monotonic(), capture.memory_in_use()
        try:
            graphs.capture_all()
        except Exception:  # noqa: BLE001 - the worker serves all the same, eagerly
            log.exception("capturing decode-step graphs failed; decode steps run eagerly")
            capture.empty_cache()
            return None
        log.info("decode steps replay %s graphs: %d batch sizes (%s) captured in %.2f s, %.0f MiB", capture.name,
                 graphs.num_graphs, ", ".join(map(str, graphs.sizes)), time.monotonic() - started,
                 (capture.memory_in_use() - before) / 2**20)
        return graphs

    def describe(self) -> ModelDescription:
        generation = self.generation_config
        # A vision-language model's config holds EOS in its text config.
        text_eos = getattr(self.config.get_text_config(), "eos_token_id", None)
        eos = _token_ids(generation.eos_token_id) + _token_ids(text_eos)
        return ModelDescription(
            model_path=str(self.model_dir),
            vocab_size=int(self.config.get_text_config().vocab_size),
            eos_token_ids=list(dict.fromkeys(eos)),
            max_position_embeddings=self.max_position_embeddings,
            device=self.backend.name,
            dtype=self.dtype_name,
            num_kv_blocks=self.kv_pool.num_blocks,
            block_size=self.block_size,
            max_batch_size=self.max_batch_size,
            sampling_defaults=SamplingDefaults(
                temperature=generation.temperature,
                top_k=generation.top_k,
                top_p=generation.top_p,
                repetition_penalty=generation.repetition_penalty,
            ),
            # A draft belongs to the step that sampled it: with MTP, one step a request.
            max_decode_steps=self.max_decode_steps,
        )

    def release(self, seq_id: int) -> None:
        """Forget a sequence's sampling state (unknown ids: no-op); its blocks are the scheduler's."""
        self.sequences.pop(seq_id, None)
        if self.mtp is not None:
            self.mtp.release(seq_id)

    def step(self, inputs: list[SequenceInput], release_seq_ids: Sequence[int] = (),
             block_copies: Sequence[tuple[int, int]] = (), decode_steps: int = 1) -> StepResult:
        """Release `release_seq_ids`, make the `block_copies` (src, dst), run `inputs`
        as one packed forward, sample; then `decode_steps - 1` more steps of the
        decodes by id among them (`extends_table`) that were not refused, each
        feeding its token from the step before (StepRequest.decode_steps).

        Returns one SampledToken per admitted input with sample=True, in input
        order, step after step, and the inputs refused alone (admission.py);
        raises INVALID_ARGUMENT to refuse the whole step, before any change but
        the releases (a later step's refusal comes after the earlier steps ran).
        """
        if not 1 <= decode_steps <= self.max_decode_steps:
            raise invalid_argument(f"decode_steps {decode_steps}: this worker runs 1 to "
                                   f"{self.max_decode_steps} steps a request")
        result = self._step(inputs, release_seq_ids, block_copies)
        if decode_steps == 1:
            return result
        refused = {r.seq_id for r in result.refused}
        decode_ids = [s.seq_id for s in inputs if s.extends_table and s.seq_id not in refused]
        tokens, execute_time_us = list(result.tokens), result.execute_time_us
        for _ in range(decode_steps - 1):
            more = self._step([decode_by_id(seq_id) for seq_id in decode_ids])
            tokens += more.tokens
            execute_time_us += more.execute_time_us
        return StepResult(tokens, execute_time_us, result.refused)

    @property
    def max_decode_steps(self) -> int:
        return 1 if self.mtp is not None else MAX_DECODE_STEPS

    @torch.inference_mode()
    def _step(self, inputs: list[SequenceInput], release_seq_ids: Sequence[int] = (),
              block_copies: Sequence[tuple[int, int]] = ()) -> StepResult:
        started = time.perf_counter()
        self._validate_copies(block_copies)
        for seq_id in release_seq_ids:
            self.release(seq_id)
        inputs, refused = self._admit(inputs)
        for refusal in refused:
            log.info("seq %d refused: %s", refusal.seq_id, refusal.message)
        if self.tensor_parallel is not None:  # admitted: what is refused above never reaches the other ranks
            self.tensor_parallel.lead(inputs, block_copies)
        self.kv_pool.copy_blocks(list(block_copies))
        tokens: list[SampledToken] = []
        if inputs:
            logits, hidden = self._forward_admitted(inputs)
            sampling_inputs = [s for s in inputs if s.sample]
            if sampling_inputs:
                tokens = self._sample(logits, sampling_inputs)
            if self.mtp is not None:
                tokens = self._with_drafts(inputs, hidden, tokens)
        self.backend.synchronize()
        elapsed = time.perf_counter() - started
        if elapsed >= _TRIM_AFTER_SECONDS:
            return_freed_memory()
        return StepResult(tokens, int(elapsed * 1e6), refused)

    @torch.inference_mode()
    def follow(self, inputs: list[SequenceInput], block_copies: Sequence[tuple[int, int]]) -> None:
        """A follower rank's part of a step rank 0 validated: the copies and the
        forward (its shard, and the collectives); no state, no sampling."""
        self.kv_pool.copy_blocks(list(block_copies))
        if inputs:
            self._run_model(inputs)

    @torch.inference_mode()
    def forward(self, inputs: list[SequenceInput]) -> torch.Tensor:
        """Validate, run the packed forward and commit the new cache lengths.

        Returns logits [num inputs with sample=True, vocab] in input order, good
        until the next step (a replayed graph writes the next step's into the
        same memory); a sequence `step` would refuse alone raises INVALID_ARGUMENT here.
        """
        inputs, refused = self._check(inputs)
        if not refused:
            inputs, refused = self._start(inputs, refused)
        if refused:
            raise invalid_argument(refused[0].message)
        return self._forward_admitted(inputs)[0]

    def _admit(self, inputs: list[SequenceInput]) -> tuple[list[SequenceInput], list[Refusal]]:
        """Check the step and set up its new sequences (compiling their grammars):
        what can refuse a sequence or the step happens here. Returns the inputs to
        run and the refused ones; the worker keeps nothing of the latter."""
        inputs, refused = self._check(inputs)
        for refusal in refused:  # one it held is refused mid-way (its context outgrew the model)
            self.sequences.pop(refusal.seq_id, None)
        return self._start(inputs, refused)

    def _start(self, inputs: list[SequenceInput],
               refused: list[Refusal]) -> tuple[list[SequenceInput], list[Refusal]]:
        """Set up the new sequences among checked `inputs`; one whose grammar does
        not compile joins `refused` and leaves the step."""
        new = [s for s in inputs if s.seq_id not in self.sequences]
        if not new:
            return inputs, refused
        states = {}
        for s in new:
            try:
                states[s.seq_id] = self._new_state(s)
            except SequenceRefused as exc:
                refused.append(Refusal(s.seq_id, exc.message))
        if len(states) < len(new):
            inputs = [s for s in inputs if s.seq_id in states or s.seq_id in self.sequences]
        self.sequences.update(states)
        return inputs, refused

    def _forward_admitted(self, inputs: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits, and with MTP every row's final hidden state."""
        logits, hidden = self._run_model(inputs)
        for s in inputs:
            state = self.sequences[s.seq_id]
            state.last_sampled = None  # fed now, or never: only the very next step may feed it
            if state.sampling.has_penalties:
                self._record_fed_tokens(state, s)
            if state.matcher is not None:
                self._replay_grammar(state, s)
            # Drafts count once kept (_sample adds them).
            state.num_cached_tokens = s.num_computed_tokens + len(s.token_ids) - s.num_draft_tokens
            state.block_table = s.block_table
        return logits, hidden

    def _run_model(self, inputs: list[SequenceInput]) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.graphs is not None and self._decode_only(inputs):
            logits = self.graphs.run([s.token_ids for s in inputs], [s.num_computed_tokens for s in inputs],
                                     [s.block_table for s in inputs])
            if logits is not None:
                return logits, None
        device = self.backend.device
        step = attention.build_paged_step(
            self.kv_pool,
            [len(s.token_ids) for s in inputs],
            [s.num_computed_tokens for s in inputs],
            [s.block_table for s in inputs],
            device,
            self.attention_kernel,
        )
        flat_ids = [t for s in inputs for t in s.token_ids]
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=device)
        # Logits only for each sampling sequence's last new token (and its drafted
        # ones): the lm_head over the whole vocab is the costliest matmul of a decode step.
        last_rows, end = [], 0
        for s in inputs:
            end += len(s.token_ids)
            if s.sample:
                last_rows.extend(range(end - speculative.num_rows(s), end))
        logit_rows = torch.tensor(last_rows, dtype=torch.long, device=device)
        if isinstance(self.decoder, VisionLanguageDecoder):
            images = [(self.sequences[s.seq_id].images, s.num_computed_tokens, len(s.token_ids)) for s in inputs]
            return self.decoder(input_ids, step, logit_rows, images), None
        if self.mtp is not None:
            return self.decoder(input_ids, step, logit_rows, keep_hidden=True)
        return self.decoder(input_ids, step, logit_rows), None

    @staticmethod
    def _decode_only(inputs: list[SequenceInput]) -> bool:
        """Every sequence feeds the same number of rows and samples each of them."""
        rows = len(inputs[0].token_ids)
        return all(s.sample and len(s.token_ids) == rows == speculative.num_rows(s) for s in inputs)

    def _with_drafts(self, inputs: list[SequenceInput], hidden: torch.Tensor,
                     tokens: list[SampledToken]) -> list[SampledToken]:
        """The step's samples, each of a sequence that may draft with the MTP module's draft."""
        drafting = {s.seq_id for s in inputs if speculative.can_draft(self.sequences[s.seq_id].sampling)}
        drafts = self.mtp.draft(inputs, hidden, tokens, drafting)
        return [dataclasses.replace(t, draft_token_ids=(drafts[t.seq_id],)) if t.seq_id in drafts else t
                for t in tokens]

    def warm_up(self) -> None:
        """Run one tiny prefill + decode so the first real step pays no one-off costs."""
        greedy = SamplingParams(temperature=0.0, top_logprobs=1)
        try:
            # Any blocks will do: nothing the scheduler owns exists yet, and slots are
            # always written before they are read.
            table = list(range(min(self.kv_pool.num_blocks, -(-4 // self.block_size))))
            if len(table) * self.block_size < 4:
                return
            first = self.step([SequenceInput(WARM_UP_SEQ_ID, [0, 1, 2], 0, True, greedy, table)])
            token = first.tokens[0].token_id
            self.step([SequenceInput(WARM_UP_SEQ_ID, [token], 3, True, None, table)])
        finally:
            self.release(WARM_UP_SEQ_ID)
