"""DeepSeek's multi-token prediction module as the worker's drafter, on a tiny
random DeepSeek-V3 with an MTP layer written as DeepSeek publishes it: the
worker's draft after each sampled token equals a reference MTP forward
(transformers' own decoder layer over the whole sequence) through a prompt
prefilled in chunks and a run of drafted decodes, and decoding with those
drafts gives transformers' greedy tokens exactly (lossless)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding

from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams, SequenceInput
from tests.moe_models import _add_mtp_layer, reference_model, stack_experts

VOCAB = 256


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory: Path = tmp_path_factory.mktemp("deepseek-mtp")
    reference = reference_model("deepseek_v3", VOCAB)
    with torch.no_grad():  # not ones: the drafter must read the hidden states after the final norm
        norm = reference.model.norm.weight
        norm.copy_(1 + 0.2 * torch.randn(norm.shape, generator=torch.Generator().manual_seed(1)))
    reference.save_pretrained(directory)
    _add_mtp_layer(directory, reference.config, seed=0)
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=8, mtp=True)
    return reference, directory, runner


def final_hidden(reference, tokens: list[int]) -> torch.Tensor:
    """The model's final hidden states [n, hidden] after its final norm: what
    the MTP module reads (as vLLM and SGLang feed it)."""
    captured = {}
    hook = reference.model.norm.register_forward_hook(lambda _m, _a, out: captured.setdefault("h", out))
    with torch.inference_mode():
        reference(torch.tensor([tokens]))
    hook.remove()
    return captured["h"][0]


def reference_drafts(reference, directory: Path, tokens: list[int]) -> list[int]:
    """The MTP module's greedy guess at position q + 2 for every q (the pairs
    (h_q, tokens[q + 1])), by transformers' own modules over the whole sequence."""
    config = reference.config
    index = config.num_hidden_layers
    tensors = load_file(directory / "model.safetensors")
    prefix = f"model.layers.{index}."
    layer = DeepseekV3DecoderLayer(config, layer_idx=index).eval()
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix) and not any(
        k[len(prefix):].startswith(n) for n in ("enorm", "hnorm", "eh_proj", "shared_head"))}
    layer.load_state_dict(stack_experts(state), strict=True)
    ids = torch.tensor([tokens])
    h = final_hidden(reference, tokens)[:-1]  # [n - 1, hidden]: positions whose next token is known
    with torch.inference_mode():

        def rms(x, weight):
            return torch.nn.functional.rms_norm(x, x.shape[-1:], weight, eps=config.rms_norm_eps)

        e = rms(reference.model.embed_tokens(ids[0, 1:]), tensors[prefix + "enorm.weight"])
        x = torch.cat([e, rms(h, tensors[prefix + "hnorm.weight"])], dim=-1) @ tensors[prefix + "eh_proj.weight"].T
        positions = torch.arange(x.shape[0])[None]
        mask = torch.full((x.shape[0], x.shape[0]), float("-inf")).triu(1)[None, None]
        out = layer(x[None], attention_mask=mask, position_ids=positions,
                    position_embeddings=DeepseekV3RotaryEmbedding(config)(x[None], positions))
        out = out[0] if isinstance(out, tuple) else out
        logits = reference.lm_head(rms(out[0], tensors[prefix + "shared_head.norm.weight"]))
    return logits.argmax(dim=-1).tolist()


def test_drafts_follow_the_mtp_module_and_decoding_with_them_is_lossless(model):
    reference, directory, runner = model
    assert runner.describe().max_decode_steps == 1  # a draft belongs to the step that sampled it
    prompt = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=14, min_new_tokens=14,
                                      do_sample=False)[0, len(prompt):].tolist()
    greedy = SamplingParams(temperature=0.0)
    table = list(range(8))
    hidden_seen = []  # the hidden states each step hands the drafter
    run_drafter = runner.mtp.draft
    runner.mtp.draft = lambda inputs, hidden, *rest: run_drafter(
        inputs, hidden_seen.append(hidden.clone()) or hidden, *rest)
    # The prompt in two chunks: the first samples nothing and leaves its last position waiting.
    assert runner.step([SequenceInput(1, prompt[:6], 0, False, greedy, table)]).tokens == []
    token = runner.step([SequenceInput(1, prompt[6:], 6, True, None, table)]).tokens[0]
    outputs, drafts_made, accepted = [token.token_id], [], 0
    while len(outputs) < len(expected):
        (draft,) = token.draft_token_ids
        drafts_made.append((len(prompt) + len(outputs), draft))
        fed = [outputs[-1], draft]
        token = runner.step([SequenceInput(1, fed, len(prompt) + len(outputs) - 1, True, None, table,
                                           num_draft_tokens=1)]).tokens[0]
        if token.num_accepted_draft_tokens:
            outputs.append(draft)
            accepted += 1
        outputs.append(token.token_id)
    runner.release(1)
    del runner.mtp.draft
    assert outputs[:len(expected)] == expected  # lossless: the model's own greedy tokens
    sequence = prompt + outputs
    # The drafter reads the final-normed hidden states (the first chunk's six positions).
    torch.testing.assert_close(hidden_seen[0], final_hidden(reference, sequence)[:6], atol=1e-4, rtol=1e-4)
    # Each draft is the module's guess at its position, given the tokens before it.
    guesses = reference_drafts(reference, directory, sequence)
    for position, draft in drafts_made:
        assert draft == guesses[position - 2], position
    print(f"{accepted} of {len(drafts_made)} drafts kept")


def test_mtp_needs_a_checkpoint_that_has_the_module(tmp_path):
    reference_model("deepseek_v3", VOCAB).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="multi-token prediction module"):
        ModelRunner(tmp_path, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                    max_batch_size=8, mtp=True)
