"""A sequence the worker cannot serve (what its request asks) is refused alone:
its batch-mates run as they would alone, the worker keeps nothing of it (no
state, no KV written), a step planned before the refusal was seen refuses it
again as unknown, and the step stream goes on (admission.py)."""
from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
import torch

from services.worker.admission import UNKNOWN_SEQUENCE
from services.worker.guided import GrammarSpec
from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput
from services.worker.server import WorkerServicer
from services.worker.vision import ImageInput
from stormserve.media.v1 import media_pb2
from stormserve.worker.v1 import worker_pb2
from tests.unit.worker.block_tables import BlockTables
from tests.unit.worker.test_server import _sampling, _with_server

PROMPT = [504, 3106, 314, 260, 1345, 30, 198, 10853, 28, 314]
SEEDED = SamplingParams(temperature=0.8, seed=11, top_logprobs=3)
GOOD, BAD = 611, 612


def _bad(sampling: SamplingParams, tokens=(5, 6, 7), **fields):
    def make(tables: BlockTables) -> SequenceInput:
        s = tables.feed(BAD, list(tokens), 0, True, sampling)
        return dataclasses.replace(s, **fields)
    return make


def _too_long(tables: BlockTables) -> SequenceInput:
    # One real block, named over and over: long enough a table, and nothing may write it.
    block = tables.table(BAD, 1)[0]
    context = 8192 + 1  # SmolLM2-135M's max_position_embeddings + 1
    return SequenceInput(BAD, [5] * context, 0, True, SamplingParams(), [block] * (context // 4 + 1))


BAD_SEQUENCES = {
    "top_logprobs": (_bad(SamplingParams(top_logprobs=1000)), "top_logprobs must be at most 256"),
    "temperature NaN": (_bad(SamplingParams(temperature=math.nan)), "temperature must be a finite number"),
    "temperature inf": (_bad(SamplingParams(temperature=math.inf)), "temperature must be a finite number"),
    "top_p NaN": (_bad(SamplingParams(top_p=math.nan)), "top_p must be in (0, 1]"),
    "repetition_penalty": (_bad(SamplingParams(repetition_penalty=5.0)), "repetition_penalty"),
    "schema not JSON": (_bad(SamplingParams(grammar=GrammarSpec("json_schema", "{not json"))), "not valid JSON"),
    "schema not an object": (_bad(SamplingParams(grammar=GrammarSpec("json_schema", "[1, 2]"))),
                             "cannot compile the grammar"),
    "lark": (_bad(SamplingParams(grammar=GrammarSpec("lark", "start: ((("))), "cannot compile the grammar"),
    "token past the vocabulary": (_bad(SamplingParams(), tokens=(5, 49152)), "outside the model's vocabulary"),
    "negative token": (_bad(SamplingParams(), tokens=(-1, 5)), "outside the model's vocabulary"),
    "context": (_too_long, "more than the model's context length (8192)"),
    "images, no tower": (_bad(SamplingParams(), images=(ImageInput(0, 1, torch.zeros(3), None),)),
                         "this model takes no images"),
    "draft with logprobs": (_bad(SamplingParams(temperature=0.0, top_logprobs=0), tokens=(5, 6, 7, 8),
                                 num_draft_tokens=2), "no draft with logprobs"),
    "first step without sampling": (_bad(None), UNKNOWN_SEQUENCE),
    "refused while read": (_bad(None, refusal="unknown grammar kind 7"), "unknown grammar kind 7"),
}


def _slots(runner: ModelRunner, table: list[int]) -> torch.Tensor:
    blocks = sorted(set(table))
    slots = torch.tensor([b * runner.block_size + o for b in blocks for o in range(runner.block_size)])
    return torch.stack([runner.kv_pool.key_cache[:, slots], runner.kv_pool.value_cache[:, slots]]).clone()


def _good_steps(tables: BlockTables, seq_id: int) -> list[SequenceInput]:
    """The good sequence's two steps as the scheduler plans them: the prompt, then
    (planned before the first answer) the token it samples."""
    return [tables.feed(seq_id, PROMPT, 0, True, SEEDED),
            dataclasses.replace(tables.feed(seq_id, [0], len(PROMPT), True), token_ids=[], feed_last_sampled=True)]


def _next_step(s: SequenceInput) -> SequenceInput:
    """The step the scheduler plans for `s` before it sees the answer to `s`."""
    computed = s.num_computed_tokens + len(s.token_ids) - s.num_draft_tokens
    return SequenceInput(s.seq_id, [], computed, True, None, s.block_table, feed_last_sampled=True)


@pytest.mark.parametrize("make_bad, message", BAD_SEQUENCES.values(), ids=BAD_SEQUENCES.keys())
def test_a_refused_sequence_leaves_its_batch_mates_as_they_run_alone(runner: ModelRunner, tables: BlockTables,
                                                                     make_bad, message):
    alone = [runner.step([s]).tokens for s in _good_steps(tables, GOOD)]
    runner.step([], release_seq_ids=[GOOD])
    tables.release(GOOD)

    bad = make_bad(tables)
    kv_before = _slots(runner, bad.block_table)
    first, second = _good_steps(tables, GOOD)
    together = [runner.step([bad, first]), runner.step([second, _next_step(bad)])]

    assert [r.tokens for r in together] == alone  # token ids, logprobs and alternatives, exactly
    assert [r.seq_id for r in together[0].refused] == [BAD]
    assert message in together[0].refused[0].message
    assert str(BAD) not in together[0].refused[0].message  # for the client: no internal ids
    assert [(r.seq_id, r.message) for r in together[1].refused] == [(BAD, UNKNOWN_SEQUENCE)]
    assert BAD not in runner.sequences and GOOD in runner.sequences
    assert torch.equal(_slots(runner, bad.block_table), kv_before)  # no KV written for it
    runner.step([], release_seq_ids=[GOOD, BAD])
    tables.release(GOOD)
    tables.release(BAD)


def test_a_prefill_chunk_after_a_refused_one_is_refused_too(runner: ModelRunner, tables: BlockTables):
    first = tables.feed(BAD, [5, 6, 7, 8], 0, False, SamplingParams(top_logprobs=1000))
    rest = tables.feed(BAD, [9, 10], 4, True)  # planned before the first chunk's answer
    assert [r.seq_id for r in runner.step([first]).refused] == [BAD]
    assert [(r.seq_id, r.message) for r in runner.step([rest]).refused] == [(BAD, UNKNOWN_SEQUENCE)]
    assert BAD not in runner.sequences
    tables.release(BAD)


def test_a_sequence_that_outgrows_the_model_is_refused_then_and_forgotten(runner: ModelRunner,
                                                                          tables: BlockTables, monkeypatch):
    monkeypatch.setattr(runner, "max_position_embeddings", 12)
    greedy = SamplingParams(temperature=0.0)
    steps = [[tables.feed(621, PROMPT, 0, True, greedy), tables.feed(622, [5, 6], 0, True, greedy)]]
    result = runner.step(steps[0])
    tokens = {t.seq_id: t.token_id for t in result.tokens}
    for length in (10, 11, 12):  # the 13th token of 621 is one too many
        result = runner.step([tables.feed(621, [tokens[621]], length, True),
                              tables.feed(622, [tokens[622]], length - 8, True)])
        tokens = {t.seq_id: t.token_id for t in result.tokens}
    assert set(tokens) == {622} and [r.seq_id for r in result.refused] == [621]
    assert "more than the model's context length (12)" in result.refused[0].message
    assert 621 not in runner.sequences
    result = runner.step([_next_step(tables.feed(621, [0], 12, True)), tables.feed(622, [tokens[622]], 5, True)])
    assert [t.seq_id for t in result.tokens] == [622] and [r.message for r in result.refused] == [UNKNOWN_SEQUENCE]
    runner.step([], release_seq_ids=[621, 622])
    tables.release(621)
    tables.release(622)


def test_refusals_travel_in_the_step_answer_and_the_stream_goes_on(runner: ModelRunner):
    """Over a real StepStream: sequences refused while the step is read (an unknown
    grammar kind, pixels that do not fill their shape) or checked (top_logprobs
    1000), the next step sent ahead naming them, then a new sequence: every step
    is answered, the good sequence samples in each."""
    good = worker_pb2.SequenceStep(seq_id=641, token_ids=PROMPT, sample=True, sampling=_sampling(top_logprobs=2),
                                   block_table=[0, 1, 2])
    bad = {
        642: dict(sampling=_sampling(top_logprobs=1000)),
        643: dict(sampling=_sampling(grammar=worker_pb2.Grammar(kind=7))),
        644: dict(sampling=_sampling(), images=[media_pb2.ImageInput(offset=0, num_tokens=1, pixel_values=b"\0" * 8,
                                                                      pixel_shape=[3])]),
    }
    first = [good] + [worker_pb2.SequenceStep(seq_id=i, token_ids=[5, 6], sample=True, block_table=[3 + n], **f)
                      for n, (i, f) in enumerate(bad.items())]
    ahead = [worker_pb2.SequenceStep(seq_id=s.seq_id, num_computed_tokens=len(s.token_ids), sample=True,
                                     block_table=s.block_table, feed_last_sampled=True) for s in first]
    after = worker_pb2.SequenceStep(seq_id=645, token_ids=[7, 8], sample=True, sampling=_sampling(), block_table=[6])

    async def calls(stub):
        stream = stub.StepStream()
        for step_id, sequences, released in ((1, first, []), (2, ahead, []), (3, [after], [641]), (4, [], [645])):
            await stream.write(worker_pb2.StepStreamRequest(step=worker_pb2.StepRequest(
                step_id=step_id, sequences=sequences, release_seq_ids=released)))
        await stream.done_writing()
        return [reply.step async for reply in stream]

    answers = asyncio.run(_with_server(WorkerServicer(runner), calls))
    assert [[t.seq_id for t in a.tokens] for a in answers] == [[641], [641], [645], []]
    refused = {r.seq_id: r.message for r in answers[0].refused}
    assert refused == {642: "top_logprobs must be at most 256", 643: "unknown grammar kind 7",
                       644: "an image's pixel_values hold 8 bytes, not float32 of shape [3]"}
    assert {r.seq_id: r.message for r in answers[1].refused} == dict.fromkeys(bad, UNKNOWN_SEQUENCE)
    assert not answers[2].refused and not answers[3].refused
    assert not {641, 642, 643, 644, 645} & set(runner.sequences)
