"""ModelRunner: the key correctness test (a packed, paged, mixed prefill/decode
batch gives the same next-token logits as a plain HF forward over each whole
sequence), generation, validation and per-sequence state."""
from __future__ import annotations

import pytest
import torch

from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput
from tests.unit.worker.block_tables import BlockTables

GREEDY = SamplingParams(temperature=0.0)

# seq_id -> full token sequence (prompt + the tokens fed back while "decoding").
LENGTHS = {101: 43, 102: 9, 103: 57, 104: 22}

# Each step: (seq_id, start, end, sample). Chunked prefills with and without a
# cached prefix, a prefill chunk that samples nothing, decodes of sequences at
# different lengths, all mixed in one packed row and in varying order.
SCHEDULE = [
    [(101, 0, 20, False), (102, 0, 5, True)],
    [(101, 20, 37, True), (102, 5, 6, True), (103, 0, 30, False)],
    [(101, 37, 38, True), (102, 6, 7, True), (103, 30, 51, True), (104, 0, 18, True)],
    [(101, 38, 39, True), (102, 7, 8, True), (103, 51, 52, True), (104, 18, 19, True)],
    [(104, 19, 20, True), (101, 39, 40, True), (103, 52, 53, True), (102, 8, 9, True)],
    [(103, 53, 56, False), (101, 40, 43, True), (104, 20, 21, True)],
    [(104, 21, 22, True), (103, 56, 57, True)],
]


def _tokens(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    # Skip the first ids (special tokens) to stay on ordinary text tokens.
    return torch.randint(100, 49152, (length,), generator=generator).tolist()


def _reference_logits(reference_model, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return reference_model(torch.tensor([tokens])).logits[0]  # [len, vocab]


def test_packed_batch_matches_hf_forward(runner: ModelRunner, tables: BlockTables, reference_model):
    sequences = {seq_id: _tokens(seq_id, n) for seq_id, n in LENGTHS.items()}
    expected = {seq_id: _reference_logits(reference_model, toks) for seq_id, toks in sequences.items()}
    free_at_start = tables.num_free_blocks
    num_checked = 0
    for step in SCHEDULE:
        inputs = [
            tables.feed(seq_id, sequences[seq_id][start:end], start, sample, GREEDY if start == 0 else None)
            for seq_id, start, end, sample in step
        ]
        logits = runner.forward(inputs)
        sampled = [(seq_id, end) for seq_id, _, end, sample in step if sample]
        assert logits.shape == (len(sampled), 49152)
        for row, (seq_id, end) in enumerate(sampled):
            want = expected[seq_id][end - 1]
            torch.testing.assert_close(logits[row], want, atol=5e-4, rtol=1e-5)
            assert logits[row].argmax() == want.argmax()
            num_checked += 1
    assert num_checked == 19
    for seq_id in LENGTHS:
        runner.release(seq_id)
        tables.release(seq_id)
    assert tables.num_free_blocks == free_at_start and not set(LENGTHS) & set(runner.sequences)


def test_greedy_generation_matches_hf_generate(runner: ModelRunner, tables: BlockTables, reference_model):
    """Feeding sampled tokens back step by step reproduces HF greedy decoding."""
    # 204 has a one-token prompt: its first step already takes the batched decode path.
    prompts = {201: _tokens(201, 12), 202: _tokens(202, 3), 203: _tokens(203, 29), 204: _tokens(204, 1)}
    num_new = 8
    generated = {seq_id: [] for seq_id in prompts}
    result = runner.step([tables.feed(s, p, 0, True, GREEDY) for s, p in prompts.items()])
    for _ in range(num_new - 1):
        for token in result.tokens:
            generated[token.seq_id].append(token.token_id)
        result = runner.step([
            tables.feed(s, [generated[s][-1]], len(p) + len(generated[s]) - 1, True)
            for s, p in prompts.items()
        ])
    for token in result.tokens:
        generated[token.seq_id].append(token.token_id)
    runner.step([], release_seq_ids=list(prompts))
    for seq_id in prompts:
        tables.release(seq_id)

    for seq_id, prompt in prompts.items():
        with torch.inference_mode():
            want = reference_model.generate(
                torch.tensor([prompt]), max_new_tokens=num_new, do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=2,
            )[0, len(prompt):].tolist()
        # HF may stop early at EOS; compare what it produced.
        assert generated[seq_id][: len(want)] == want


def test_released_blocks_are_reused_correctly(runner: ModelRunner, tables: BlockTables, reference_model):
    """A sequence placed in blocks another sequence just freed sees none of its data."""
    first, second = _tokens(301, 30), _tokens(302, 30)
    runner.step([tables.feed(301, first, 0, False, GREEDY)])
    runner.release(301)
    tables.release(301)
    logits = runner.forward([tables.feed(301, second[:20], 0, False, GREEDY)])
    assert logits.shape[0] == 0
    logits = runner.forward([tables.feed(301, second[20:], 20, True)])
    want = _reference_logits(reference_model, second)[-1]
    torch.testing.assert_close(logits[0], want, atol=5e-4, rtol=1e-5)
    runner.release(301)
    tables.release(301)


def test_new_sequence_starts_on_shared_prefix_blocks(runner: ModelRunner, tables: BlockTables, reference_model):
    """Prefix caching: a new sequence given another's full blocks (num_computed_tokens > 0
    on its first step) reads their KV and only computes its own tail."""
    prompt = _tokens(311, 22)
    runner.step([tables.feed(311, prompt[:16], 0, False, GREEDY)])  # 4 full blocks of 4
    shared = tables.table(311, 16)
    own = tables.table(312, 8)[:2]  # 2 private blocks for positions 16..23
    logits = runner.forward([SequenceInput(312, prompt[16:], 16, True, GREEDY, shared + own)])
    torch.testing.assert_close(logits[0], _reference_logits(reference_model, prompt)[-1], atol=5e-4, rtol=1e-5)
    for seq_id in (311, 312):
        runner.release(seq_id)
        tables.release(seq_id)


def test_recomputed_outputs_keep_penalties_and_seeded_draws(runner: ModelRunner, tables: BlockTables):
    """A sequence released (preempted) and fed again from scratch with its earlier
    outputs, num_prompt_tokens telling them apart, continues exactly as if never stopped."""
    params = SamplingParams(temperature=0.8, seed=7, frequency_penalty=1.0, top_logprobs=0)
    prompt = _tokens(321, 9)
    result = runner.step([tables.feed(321, prompt, 0, True, params)])
    generated = [result.tokens[0].token_id]
    for _ in range(5):
        result = runner.step([tables.feed(321, [generated[-1]], len(prompt) + len(generated) - 1, True)])
        generated.append(result.tokens[0].token_id)
    runner.release(321)
    tables.release(321)
    # Same sequence, preempted after 3 outputs and recomputed in two chunks.
    replay = [generated[0]]
    result = runner.step([tables.feed(322, prompt, 0, True, params)])
    for _ in range(2):
        result = runner.step([tables.feed(322, [replay[-1]], len(prompt) + len(replay) - 1, True)])
        replay.append(result.tokens[0].token_id)
    runner.release(322)
    tables.release(322)
    history = prompt + replay
    runner.step([tables.feed(322, history[:5], 0, False, params, num_prompt_tokens=len(prompt))])
    result = runner.step([tables.feed(322, history[5:], 5, True)])
    replay.append(result.tokens[0].token_id)
    for _ in range(2):
        result = runner.step([tables.feed(322, [replay[-1]], len(prompt) + len(replay) - 1, True)])
        replay.append(result.tokens[0].token_id)
    assert replay == generated
    assert runner.sequences[322].output_token_ids == generated
    runner.release(322)
    tables.release(322)


@pytest.mark.parametrize(
    "bad, message",
    [
        (SequenceInput(401, [1, 2], 5, True, GREEDY, [0]), "cannot hold"),
        (SequenceInput(401, [1, 2], 0, True, GREEDY, [10**6]), "block id outside"),
        (SequenceInput(401, [], 0, True, GREEDY), "token_ids is empty"),
    ],
)
def test_bad_steps_are_rejected_and_change_nothing(runner: ModelRunner, bad, message):
    """Steps that contradict the worker's state (scheduler bugs) are refused whole;
    what a request asks is refused per sequence (test_refusals.py)."""
    from services.common.errors import ServiceError

    with pytest.raises(ServiceError, match=message) as info:
        runner.step([SequenceInput(402, [5, 6, 7], 0, True, GREEDY, [0]), bad])
    assert info.value.code.name == "INVALID_ARGUMENT"
    assert 402 not in runner.sequences


def test_wrong_num_computed_tokens_is_rejected(runner: ModelRunner):
    from services.common.errors import ServiceError

    runner.step([SequenceInput(501, [5, 6, 7], 0, True, GREEDY, [0])])
    with pytest.raises(ServiceError, match="holds 3 tokens"):
        runner.step([SequenceInput(501, [8], 4, True, None, [0, 1])])
    runner.release(501)


def test_penalty_history_separates_prompt_and_generated_tokens(runner: ModelRunner, tables: BlockTables):
    params = SamplingParams(temperature=0.0, frequency_penalty=1.5, presence_penalty=0.5)
    prompt = _tokens(901, 10)
    runner.step([tables.feed(901, prompt[:6], 0, False, params)])
    result = runner.step([tables.feed(901, prompt[6:], 6, True)])
    generated = [result.tokens[0].token_id]
    for _ in range(5):
        result = runner.step([tables.feed(901, [generated[-1]], len(prompt) + len(generated) - 1, True)])
        generated.append(result.tokens[0].token_id)
    state = runner.sequences[901]
    assert state.prompt_token_ids == prompt
    assert state.output_token_ids == generated
    runner.release(901)
    tables.release(901)
    assert 901 not in runner.sequences


def test_fork_continues_from_a_copied_partial_block(runner: ModelRunner, tables: BlockTables, reference_model):
    """Beam search forks: the new sequence shares the parent's full blocks, gets a
    copy of its partial one, and both go on with different tokens, each reading
    exactly its own context."""
    prompt = _tokens(321, 10)  # 2 full blocks of 4, and 2 tokens in a third
    runner.step([tables.feed(321, prompt, 0, False, GREEDY)])
    parent_table = tables.table(321, 11)
    child_own = tables.table(322, 4)[:1]
    child_table = parent_table[:2] + child_own
    a, b = 7, 9
    result = runner.step(
        [SequenceInput(321, [a], 10, True, None, parent_table),
         SequenceInput(322, [b], 10, True, GREEDY, child_table, num_prompt_tokens=10)],
        block_copies=[(parent_table[2], child_own[0])],
    )
    logits = runner.forward([SequenceInput(321, [result.tokens[0].token_id], 11, True, None, tables.table(321, 12)),
                             SequenceInput(322, [result.tokens[1].token_id], 11, True, None, child_table)])
    for row, context in enumerate((prompt + [a, result.tokens[0].token_id], prompt + [b, result.tokens[1].token_id])):
        torch.testing.assert_close(logits[row], _reference_logits(reference_model, context)[-1], atol=5e-4, rtol=1e-5)
    for seq_id in (321, 322):
        runner.release(seq_id)
        tables.release(seq_id)
