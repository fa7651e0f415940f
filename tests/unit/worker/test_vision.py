"""Vision-language models on the worker: tiny random-weight LLaVA, Qwen2-VL
and Qwen2.5-VL models give the logits of transformers' own forward of the
same model (float32, pixels from the model's own image processor), with the
prompt's prefill chunked so that one image spans two steps, a text-only
sequence and images of several sequences in the same packed steps, and decode
steps after it (Qwen2-VL: the M-RoPE position offset an image leaves); and the
pixels the worker gets are the tokenizer's processor's, bit for bit."""
from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

from services.common.errors import ServiceError
from services.scheduler.config import SchedulerConfig
from services.scheduler.convert import to_sequence
from services.scheduler.worker_client import step_request
from services.tokenizer.media import MediaItem
from services.tokenizer.multimodal import ImageProcessor
from services.tokenizer.server import _generate_request
from services.tokenizer.template import RenderedPrompt
from services.worker.convert import step_from_proto
from services.worker.platforms import select_platform
from services.worker.model_runner import ModelRunner
from services.worker.sequence import SamplingParams, SequenceInput
from services.worker.vision import ImageInput, VisionLanguageDecoder, mrope_positions
from stormserve.chat.v1 import chat_pb2
from stormserve.scheduler.v1 import scheduler_pb2
from stormserve.worker.v1 import worker_pb2
from tests.unit.scheduler.test_policy import make_policy
from tests.unit.worker.block_tables import BlockTables
from tests.vlm_models import FAMILIES, build_vlm


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_vlm(request.param, tmp_path_factory.mktemp(request.param))


def _image(seed: int, width: int, height: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _prompt(directory: Path, family: str, images: list[Image.Image]) -> tuple[list[int], list[ImageInput], dict]:
    """Token ids with each image's placeholders expanded, the images as the
    worker gets them, and the HF forward's image kwargs."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    processed = AutoImageProcessor.from_pretrained(directory)(images=images, return_tensors="pt")
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    ids = encode("<|im_start|>user\nWhat is in")
    inputs: list[ImageInput] = []
    patches = 0
    for index in range(len(images)):
        if family != "llava":
            grid = tuple(int(v) for v in processed["image_grid_thw"][index])
            num = grid[0] * grid[1] * grid[2]
            pixels, num_tokens = processed["pixel_values"][patches: patches + num], num // 4
            patches += num
            ids += encode(" this<|vision_start|>")
            token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
        else:
            grid, pixels, num_tokens = None, processed["pixel_values"][index], 16
            ids += encode(" this")
            token = tokenizer.convert_tokens_to_ids("<image>")
        inputs.append(ImageInput(len(ids), num_tokens, pixels, grid))
        ids += [token] * num_tokens
        if family != "llava":
            ids += encode("<|vision_end|>")
    ids += encode(" picture?<|im_end|>\n<|im_start|>assistant\n")
    return ids, inputs, dict(processed)


def test_logits_match_transformers(family_dir):
    family, directory = family_dir
    torch.manual_seed(0)
    ids, images, hf_kwargs = _prompt(directory, family, [_image(1, 100, 70), _image(2, 60, 90)])
    text_ids = torch.randint(0, 1000, (9,)).tolist()
    generated = [17, 42, 7]  # fed back as decodes
    full = ids + generated
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    with torch.inference_mode():
        if family != "llava":
            hf_kwargs["mm_token_type_ids"] = (torch.tensor([full]) == reference.config.image_token_id).int()
        expected = reference(input_ids=torch.tensor([full]), **hf_kwargs).logits[0]
        expected_text = reference(input_ids=torch.tensor([text_ids])).logits[0]

    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=4)
    assert isinstance(runner.decoder, VisionLanguageDecoder)
    tower_calls = []  # images per call of the real tower
    encode = runner.decoder.encode
    runner.decoder.encode = lambda reached: tower_calls.append(len(reached)) or encode(reached)
    tables = BlockTables(runner)
    greedy = SamplingParams(temperature=0.0)
    first = tables.feed(1, ids[:images[0].offset + 3], 0, False, greedy)  # ends inside the first image
    # Step 2 reaches three images at once (seq 1's second, seq 3's two): one tower call.
    whole = dataclasses.replace(tables.feed(3, ids, 0, True, greedy), images=tuple(images))
    steps = [
        [dataclasses.replace(first, images=tuple(images)), tables.feed(2, text_ids[:5], 0, True, greedy)],
        [tables.feed(1, ids[len(first.token_ids):], len(first.token_ids), True),
         tables.feed(2, text_ids[5:], 5, True), whole],
    ] + [[tables.feed(1, [token], len(ids) + i, True)] for i, token in enumerate(generated)]
    for step in steps:
        logits = runner.forward(step)
        for row, s in enumerate(s for s in step if s.sample):
            end = s.num_computed_tokens + len(s.token_ids)
            want = expected_text[end - 1] if s.seq_id == 2 else expected[end - 1]
            torch.testing.assert_close(logits[row], want, atol=1e-4, rtol=1e-4)
    assert tower_calls == [1, 3]  # each image encoded once, however the chunks fell
    kept = runner.sequences[1].images  # both images passed: no embeddings, no pixels kept
    assert kept.embeddings == {} and all(image.pixel_values is None for image in kept.images)


def test_image_span_must_hold_image_tokens(family_dir):
    family, directory = family_dir
    ids, images, _ = _prompt(directory, family, [_image(3, 56, 56)])
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=4)
    tables = BlockTables(runner)
    shifted = dataclasses.replace(images[0], offset=images[0].offset - 1)
    with pytest.raises(ServiceError, match="image token"):
        runner.forward([dataclasses.replace(tables.feed(1, ids, 0, True, SamplingParams()), images=(shifted,))])


def test_mrope_positions_of_any_window_match_the_whole():
    images = (ImageInput(3, 4, torch.empty(0), (1, 4, 4)), ImageInput(9, 6, torch.empty(0), (1, 4, 6)))
    whole = mrope_positions(images, 0, 21, merge_size=2)
    # text 0..2; a 2x2 grid from 3; text goes on at 3 + 2 = 5; a 2x3 grid from 7 (position 9); text at 7 + 3 = 10.
    assert whole[:, :3].tolist() == [[0, 1, 2]] * 3
    assert whole[:, 3:7].tolist() == [[3, 3, 3, 3], [3, 3, 4, 4], [3, 4, 3, 4]]
    assert whole[:, 7:9].tolist() == [[5, 6]] * 3
    assert whole[:, 15:].tolist() == [[10, 11, 12, 13, 14, 15]] * 3
    for start in range(0, 19, 3):
        assert torch.equal(mrope_positions(images, start, 3, merge_size=2), whole[:, start:start + 3])


def test_an_image_in_cached_blocks_needs_no_pixels(family_dir):
    family, directory = family_dir
    ids, images, hf_kwargs = _prompt(directory, family, [_image(4, 84, 56)])
    reference = AutoModelForImageTextToText.from_pretrained(directory, dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    with torch.inference_mode():
        if family != "llava":
            hf_kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == reference.config.image_token_id).int()
        expected = reference(input_ids=torch.tensor([ids]), **hf_kwargs).logits[0, -1]
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=4)
    tables = BlockTables(runner)
    greedy = SamplingParams(temperature=0.0)
    runner.forward([dataclasses.replace(tables.feed(1, ids, 0, True, greedy), images=tuple(images))])
    # A second sequence on the first one's full blocks past the image (a prefix-cache hit):
    # its image comes without pixels, and its positions (M-RoPE's shift) still count it.
    num_cached = images[0].end // 4 * 4 + 4
    shared = tables.table(1, len(ids))[: num_cached // 4]
    own = tables.table(2, len(ids) - num_cached)
    no_pixels = tuple(dataclasses.replace(image, pixel_values=None) for image in images)
    hit = SequenceInput(2, ids[num_cached:], num_cached, True, greedy, shared + own, images=no_pixels)
    torch.testing.assert_close(runner.forward([hit])[0], expected, atol=1e-4, rtol=1e-4)
    # A step that computes the image's tokens needs its pixels.
    with pytest.raises(ServiceError, match="without pixels"):
        runner.forward([dataclasses.replace(tables.feed(3, ids, 0, True, greedy), images=no_pixels)])


def test_bfloat16_stays_close_to_float32(family_dir):
    """The worker's default dtype: the tower, the projector and the paged language
    model in bfloat16, within bfloat16's rounding of the float32 logits."""
    family, directory = family_dir
    ids, images, _ = _prompt(directory, family, [_image(5, 70, 100)])
    logits = {}
    for dtype in ("float32", "bfloat16"):
        runner = ModelRunner(directory, select_platform("cpu"), dtype, block_size=4, kv_cache_bytes=2**20,
                             max_batch_size=4)
        tables = BlockTables(runner)
        first = dataclasses.replace(tables.feed(1, ids, 0, True, SamplingParams(temperature=0.0)),
                                    images=tuple(images))
        logits[dtype] = torch.cat([runner.forward([first]), runner.forward([tables.feed(1, [5], len(ids), True)])])
    torch.testing.assert_close(logits["bfloat16"].float(), logits["float32"], atol=0.02, rtol=0.02)


def test_pixels_reach_the_worker_as_the_processor_left_them(family_dir):
    """The tokenizer's processed image, serialized at each hop (the tokenizer's
    GenerateRequest, the scheduler's sequence and worker step, the worker's step
    conversion), is the image processor's own tensor: values, shape and dtype."""
    family, directory = family_dir
    config = AutoConfig.from_pretrained(directory)
    image = _image(6, 100, 70)
    item = MediaItem("image", image.tobytes(), "png", hashlib.sha256(image.tobytes()).hexdigest(), image)
    token_ids, processed = ImageProcessor(directory, config).expand([5, config.image_token_id, 6], [item])
    generate = _generate_request(chat_pb2.ChatRequest(max_tokens=4), "r1", RenderedPrompt("", token_ids, processed), 0,
                                 None, None)
    sequence = to_sequence(scheduler_pb2.GenerateRequest.FromString(generate.SerializeToString()), 1,
                           SchedulerConfig(), now_us=0)
    policy = make_policy()
    policy.add(sequence)
    step = worker_pb2.StepRequest.FromString(step_request(policy.schedule()).SerializeToString())
    ((received,),) = [s.images for s in step_from_proto(step)[0]]

    expected = AutoImageProcessor.from_pretrained(directory)(images=[image], return_tensors="pt")["pixel_values"]
    if family == "llava":
        expected = expected[0]  # one image's [channels, height, width]
    assert received.pixel_values.dtype == expected.dtype == torch.float32
    assert received.pixel_values.shape == expected.shape
    assert torch.equal(received.pixel_values, expected)
    assert (received.offset, received.num_tokens, received.grid_thw) == (
        processed[0].offset, processed[0].num_tokens, processed[0].grid_thw)
