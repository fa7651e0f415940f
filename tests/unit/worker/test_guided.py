"""Constrained decoding: whatever the logits say, the masked choice follows the grammar."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from services.common.model_files import default_model_path, resolve_model
from services.worker.guided import GrammarError, GrammarSpec, GuidedDecoding, _unpack_bits

EOS = 2
VOCAB = 49152
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"},
                   "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "days", "unit"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(default_model_path()))


@pytest.fixture(scope="module")
def guided(tokenizer):
    return GuidedDecoding(tokenizer, VOCAB, [EOS])


def generate(guided, spec, seed, bias=None, max_steps=300):
    """Greedy over random logits (biased towards `bias` tokens), masked by the grammar."""
    generator = torch.Generator().manual_seed(seed)
    matcher = guided.compile(spec)
    tokens = []
    for _ in range(max_steps):
        logits = torch.randn(2, VOCAB, generator=generator)
        if bias is not None:
            logits[:, bias] += 6.0
        guided.mask_logits(logits, [None, matcher])  # row 0 is an unconstrained neighbour
        token = int(logits[1].argmax())
        if token == EOS:
            return tokens, matcher
        guided.advance(matcher, token)
        tokens.append(token)
    raise AssertionError("the grammar never let the sequence end")


def closing_bias(tokenizer):
    # Pull random walks towards short strings and closing quotes/braces so they end.
    ids = {tokenizer.convert_tokens_to_ids(t) for t in ['"', "}", ",", 'Ġ"']}
    return torch.tensor(sorted(ids | {EOS}))


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(guided, tokenizer, seed):
    tokens, matcher = generate(guided, GrammarSpec("json_schema", json.dumps(SCHEMA)), seed,
                               bias=closing_bias(tokenizer))
    value = json.loads(tokenizer.decode(tokens))
    assert set(value) == {"city", "days", "unit"}
    assert isinstance(value["city"], str) and len(value["city"]) <= 12
    assert isinstance(value["days"], int) and value["unit"] in ("celsius", "fahrenheit")
    assert matcher.is_stopped() or matcher.is_accepting()


@pytest.mark.parametrize("seed", range(3))
def test_json_object_output_parses(guided, tokenizer, seed):
    tokens, _ = generate(guided, GrammarSpec("json_object"), seed, bias=closing_bias(tokenizer))
    assert isinstance(json.loads(tokenizer.decode(tokens)), dict)


def test_unconstrained_rows_are_untouched(guided):
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    guided.mask_logits(logits, [None, guided.compile(GrammarSpec("json_object"))])
    assert torch.equal(logits[0], before[0])
    assert torch.isinf(logits[1]).sum() > VOCAB // 2


def test_bad_schema_is_a_clear_error(guided):
    with pytest.raises(GrammarError):
        guided.compile(GrammarSpec("json_schema", "{not json"))
    with pytest.raises(GrammarError):
        guided.compile(GrammarSpec("json_schema", json.dumps({"type": "no-such-type"})))


def test_runner_follows_the_schema_with_the_real_model(runner, tables, tokenizer):
    """A greedy sequence under a schema yields valid JSON and then EOS, beside a free one."""
    from services.worker.sequence import SamplingParams

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give the weather in Paris as JSON."}], add_generation_prompt=True,
        tokenize=True, return_dict=True)["input_ids"]
    constrained = SamplingParams(temperature=0.0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    free = SamplingParams(temperature=0.0)
    inputs = [tables.feed(101, prompt, 0, True, constrained, len(prompt)),
              tables.feed(102, prompt, 0, True, free, len(prompt))]
    outputs: dict[int, list[int]] = {101: [], 102: []}
    try:
        for _ in range(80):
            result = runner.step(inputs)
            inputs = []
            for token in result.tokens:
                outputs[token.seq_id].append(token.token_id)
                n = len(prompt) + len(outputs[token.seq_id])
                if token.seq_id == 101 and token.token_id == EOS:
                    continue
                if token.seq_id == 102 and len(outputs[102]) >= 10:
                    continue
                inputs.append(tables.feed(token.seq_id, [token.token_id], n - 1, True))
            if not inputs:
                break
    finally:
        runner.step([], [101, 102])
        tables.release(101)
        tables.release(102)
    assert outputs[101][-1] == EOS
    value = json.loads(tokenizer.decode(outputs[101][:-1]))
    assert set(value) == {"city", "days", "unit"} and value["unit"] in ("celsius", "fahrenheit")
    assert not tokenizer.decode(outputs[102]).lstrip().startswith("{")  # the free neighbour stays free


def test_mask_bits_map_to_tokens_including_the_sign_bit():
    words = torch.tensor([[1 | (1 << 31) - 2**32, 0b101]], dtype=torch.int32)  # tokens 0, 31, 32, 34
    allowed = _unpack_bits(words, 70)
    assert allowed.shape == (1, 70)
    assert allowed[0].nonzero().flatten().tolist() == [0, 31, 32, 34]
    assert _unpack_bits(words, 33)[0].nonzero().flatten().tolist() == [0, 31, 32]
