"""Runs the model one step at a time over the paged KV cache.

A step: release finished sequences, check the batch against what the worker
holds (admission.py: a sequence it cannot serve is left out and reported, a
step that contradicts its state is refused whole), pack every sequence's new
tokens into one row, run the HF model once (logits only for the last token of
each sampling sequence), sample on the device, and commit the new cache lengths.

The scheduler owns the KV blocks: every input carries its block table, and the
worker reads and writes the pool only through it (it allocates nothing itself).

Not thread-safe by design: the server calls `step` from one worker thread.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from services.common.errors import invalid_argument
from services.common.media_parts import has_vision_tower
from services.worker import attention, quant_formats, quantization, sampler, speculative
from services.worker.admission import StepAdmission
from services.worker.platforms import Platform, torch_dtype
from services.worker.checkpoint import Checkpoint
from services.worker.decoder import SUPPORTED_MODEL_TYPES, LeanDecoder
from services.worker.graphs import GraphCapture, StepGraphs
from services.worker.guided import GrammarError, GuidedDecoding
from services.worker.kv_cache import KVCachePool, KVCacheSpec
from services.worker.model_loading import (
    Decoder, auto_kv_budget, generation_config, hf_decoder, load_hf_model, return_freed_memory)
from services.worker.mtp import MtpDrafter, check_mtp
from services.worker.parallel import TensorParallel
from services.worker.penalties import apply_penalties
from services.worker.sequence import (
    Refusal, SampledToken, SamplingParams, SequenceInput, SequenceRefused, StepResult)
from services.worker.vision import SequenceImages, VisionLanguageDecoder

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


@dataclass
class SequenceState:
    """What the worker keeps about a live sequence between steps."""

    sampling: SamplingParams
    generator: torch.Generator | None  # None for greedy sequences
    num_cached_tokens: int = 0
    # Tokens before this position are prompt; None until known (the first sample
    # fixes it when the scheduler did not say). Tokens after it are outputs.
    num_prompt_tokens: int | None = None
    # Outputs drawn from `generator` so far: a sequence recomputed after a
    # preemption skips the draws of its earlier outputs, so a seed gives the same text.
    num_draws: int = 0
    # Token history, kept only for sequences with penalties.
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    # Constrained decoding: the grammar state and how many outputs it has consumed.
    matcher: object | None = None
    num_grammar_tokens: int = 0
    # The token sampled last, until the sequence is next fed: a step that feeds
    # it without knowing it (feed_last_sampled) takes it from here.
    last_sampled: int | None = None
    # A vision-language model's images of the sequence; None without.
    images: SequenceImages | None = None


# After a step that ran at least this long (a prefill, decodes over long contexts),
# the heap its activations freed goes back to the OS (return_freed_memory): the
# trim's 1 to 15 ms are then a few percent of the step at most.
_TRIM_AFTER_SECONDS = 0.1


def _token_ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]


class ModelRunner(StepAdmission):
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
        )

    def release(self, seq_id: int) -> None:
        """Forget a sequence's sampling state (unknown ids: no-op); its blocks are the scheduler's."""
        self.sequences.pop(seq_id, None)
        if self.mtp is not None:
            self.mtp.release(seq_id)

    @torch.inference_mode()
    def step(self, inputs: list[SequenceInput], release_seq_ids: Sequence[int] = (),
             block_copies: Sequence[tuple[int, int]] = ()) -> StepResult:
        """Release `release_seq_ids`, make the `block_copies` (src, dst), run `inputs`
        as one packed forward, sample.

        Returns one SampledToken per admitted input with sample=True, in input
        order, and the inputs refused alone (admission.py); raises
        INVALID_ARGUMENT to refuse the whole step, before any change but the releases.
        """
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
        return logits, hidden

    def _new_state(self, s: SequenceInput) -> SequenceState:
        sampling = s.sampling
        assert sampling is not None  # checked by _check
        generator = None
        if not sampling.is_greedy:
            # Seeded once: the sequence's draws depend on its seed alone, not on the batch.
            generator = torch.Generator()  # CPU: the sampler draws one scalar per token
            generator.manual_seed(sampling.seed)
        state = SequenceState(sampling=sampling, generator=generator, num_prompt_tokens=s.num_prompt_tokens or None,
                              images=SequenceImages(list(s.images)) if s.images else None)
        if sampling.grammar is not None:
            guided = self.guided
            try:
                state.matcher = guided.compile(sampling.grammar)
            except GrammarError as exc:
                raise SequenceRefused(str(exc)) from exc
            except ValueError as exc:  # llguidance's own, e.g. a schema that is not an object
                raise SequenceRefused(f"cannot compile the grammar: {exc}") from exc
            except Exception as exc:  # noqa: BLE001 - the request's grammar, not the worker, is at fault
                log.exception("seq %d: compiling its grammar failed", s.seq_id)
                raise SequenceRefused("cannot compile the grammar") from exc
        return state

    @property
    def guided(self) -> GuidedDecoding:
        if self._guided is None:
            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
            self._guided = GuidedDecoding(tokenizer, self.vocab_size, self.describe().eos_token_ids)
        return self._guided

    def _replay_grammar(self, state: SequenceState, s: SequenceInput) -> None:
        # Outputs fed back after a preemption re-enter the grammar; the last sample
        # coming back as the next input was consumed when it was sampled.
        num_prompt = state.num_prompt_tokens or s.num_prompt_tokens
        if not num_prompt:
            return
        for position, token in enumerate(s.token_ids, start=s.num_computed_tokens):
            if position - num_prompt == state.num_grammar_tokens:
                self.guided.advance(state.matcher, token)
                state.num_grammar_tokens += 1

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

    def _record_fed_tokens(self, state: SequenceState, s: SequenceInput) -> None:
        # A fed token at a position the worker already sampled is that sample coming back;
        # tokens past the prompt fed on a first step are outputs being recomputed.
        known = len(state.prompt_token_ids) + len(state.output_token_ids)
        for position, token in enumerate(s.token_ids, start=s.num_computed_tokens):
            if position < known:
                continue
            if state.num_prompt_tokens is None or position < state.num_prompt_tokens:
                state.prompt_token_ids.append(token)
            else:
                state.output_token_ids.append(token)

    def _sample(self, logits: torch.Tensor, inputs: list[SequenceInput]) -> list[SampledToken]:
        """One token per input, from its logit rows (several for a draft: speculative.py)."""
        for s in inputs:
            self._skip_recomputed_draws(self.sequences[s.seq_id])
        # Row order: each input's rows in turn; a drafting sequence's generator is
        # listed once per row, so its numbers are drawn in position order.
        states = [self.sequences[s.seq_id] for s in inputs for _ in range(speculative.num_rows(s))]
        rewind_to = {s.seq_id: self.sequences[s.seq_id].generator.get_state() for s in inputs
                     if s.num_draft_tokens and self.sequences[s.seq_id].generator is not None}
        params = [st.sampling for st in states]
        if any(p.has_penalties for p in params):
            logits = apply_penalties(
                logits.float(),
                params,
                [st.prompt_token_ids for st in states],
                [st.output_token_ids for st in states],
            )
        matchers = [st.matcher for st in states]
        if any(m is not None for m in matchers):
            self.guided.mask_logits(logits, matchers)
        out = sampler.sample(logits, params, [st.generator for st in states])
        tokens, row = [], 0
        for s in inputs:
            state = self.sequences[s.seq_id]
            kept = speculative.num_accepted(s.token_ids[len(s.token_ids) - s.num_draft_tokens:],
                                            out.token_ids[row:row + s.num_draft_tokens])
            if s.num_draft_tokens:
                speculative.rewind(state.generator, rewind_to.get(s.seq_id), kept + 1)
                state.num_cached_tokens += kept
                state.num_draws += kept
            i = row + kept
            row += speculative.num_rows(s)
            if state.sampling.has_penalties:
                state.output_token_ids.append(out.token_ids[i])
            if state.matcher is not None:
                self.guided.advance(state.matcher, out.token_ids[i])
                state.num_grammar_tokens += 1
            state.last_sampled = out.token_ids[i]
            tokens.append(SampledToken(s.seq_id, out.token_ids[i], out.logprobs[i], out.top_logprobs[i], kept))
        return tokens

    @staticmethod
    def _skip_recomputed_draws(state: SequenceState) -> None:
        """Advance the generator past outputs sampled before a preemption (the
        sampler takes one number per token of a non-greedy sequence)."""
        if state.num_prompt_tokens is None:
            state.num_prompt_tokens = state.num_cached_tokens
        num_outputs_before = state.num_cached_tokens - state.num_prompt_tokens
        if state.generator is not None:
            for _ in range(num_outputs_before - state.num_draws):
                sampler.draw_uniform(state.generator)
        state.num_draws = num_outputs_before + 1

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
