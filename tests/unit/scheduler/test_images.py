"""A vision-language request's images on their way to the worker: pixels go
only with a step that computes some of the image's tokens, and one step
carries at most MAX_STEP_IMAGE_BYTES of them."""
from __future__ import annotations

from services.common.media_parts import MAX_STEP_IMAGE_BYTES
from services.scheduler.sequence import ImageSpan
from services.scheduler.worker_client import step_request
from stormserve.media.v1 import media_pb2
from tests.unit.scheduler.test_policy import FakeWorker, make_policy, make_seq

IMAGE_TOKEN = 99


def _with_image(seq_id: int, content_hash: bytes, num_bytes: int = 0):
    """14 prompt tokens: 3 of text, an image's 6 tokens at 3..8, 5 of text."""
    seq = make_seq(seq_id, prompt_len=14)
    seq.prompt_token_ids[3:9] = [IMAGE_TOKEN] * 6
    message = media_pb2.ImageInput(content_hash=content_hash, offset=3, num_tokens=6,
                                   pixel_values=b"\0" * 16, pixel_shape=[4], grid_thw=[1, 2, 3])
    seq.images = (ImageSpan(content_hash, 3, 6, message, num_bytes or message.ByteSize()),)
    return seq


def test_pixels_go_only_to_a_step_that_computes_the_image():
    policy = make_policy(max_prefill_tokens=1000)
    worker = FakeWorker(token=7, policy=policy)
    first = _with_image(1, b"A" * 32)
    policy.add(first)
    plan = policy.schedule()
    (step,) = step_request(plan).sequences
    assert step.images[0].pixel_values == b"\0" * 16 and list(step.images[0].grid_thw) == [1, 2, 3]
    policy.postprocess(plan, worker.step(plan), 0, 1)
    # The same image again: its blocks come from the cache, so only its span and grid go.
    again = _with_image(2, b"A" * 32)
    policy.add(again)
    plan = policy.schedule()
    step = next(s for s in step_request(plan).sequences if s.seq_id == 2)
    assert step.num_computed_tokens == 12
    assert step.images[0].pixel_values == b"" and list(step.images[0].pixel_shape) == []
    assert (step.images[0].offset, step.images[0].num_tokens, list(step.images[0].grid_thw)) == (3, 6, [1, 2, 3])


def test_one_step_admits_images_up_to_its_byte_budget():
    policy = make_policy(max_prefill_tokens=1000)
    big = MAX_STEP_IMAGE_BYTES // 2 + 1
    for seq_id, content_hash in ((1, b"A" * 32), (2, b"B" * 32)):
        policy.add(_with_image(seq_id, content_hash, num_bytes=big))
    policy.add(make_seq(3))
    assert [e.seq.seq_id for e in policy.schedule().scheduled] == [1]  # 2 waits, and 3 behind it


def test_any_slice_of_the_cache_keys_is_cut_from_the_prompts_and_the_outputs():
    for seq in (_with_image(1, b"a"), make_seq(2, prompt_len=12)):
        seq.output_token_ids = [50, 51, 52, 53]
        keys = seq.cache_keys
        assert len(keys) == seq.num_tokens and (not seq.images or keys[3] == (seq.prompt_token_ids[3], b"a"))
        for start in range(len(keys) + 1):
            for end in range(start, len(keys) + 1):
                assert seq.cache_keys_in(start, end) == keys[start:end], (start, end)
