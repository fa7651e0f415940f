"""Images a vision-language model cannot take refuse their own sequence, not
the step: pixels of another shape than the model's, placeholders other than
the embeddings an image gives, an image reached without pixels, a span that
holds other tokens, spans out of order; the good sequence beside it (an image
of its own, encoded in the same step) gets what it gets alone."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from services.worker.model_runner import ModelRunner
from services.worker.platforms import select_platform
from services.worker.sequence import SamplingParams
from services.worker.vision import ImageInput
from tests.unit.worker.block_tables import BlockTables
from tests.unit.worker.test_vision import _image, _prompt
from tests.vlm_models import build_vlm

GREEDY = SamplingParams(temperature=0.0, top_logprobs=3)


@pytest.fixture(scope="module", params=("llava", "qwen2_vl"))
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, build_vlm(request.param, tmp_path_factory.mktemp(request.param))


def _spoiled(family: str, image: ImageInput) -> dict[str, tuple[tuple[ImageInput, ...], str]]:
    """Ways to spoil a sequence's one image: (its images, what the refusal says)."""
    pixels = image.pixel_values
    assert pixels is not None
    cases = {
        "pixel shape": ((dataclasses.replace(image, pixel_values=pixels[..., :-1]),), "pixel_shape is"),
        "placeholders": ((dataclasses.replace(image, num_tokens=image.num_tokens - 1),), "placeholder tokens"),
        "no pixels": ((dataclasses.replace(image, pixel_values=None),), "without pixels"),
        "span of other tokens": ((dataclasses.replace(image, offset=image.offset - 1),), "image token"),
        "overlapping": ((image, dataclasses.replace(image, offset=image.offset + 1)), "position order"),
    }
    if family != "llava":
        cases["no grid"] = ((dataclasses.replace(image, grid_thw=None),), "grid_thw")
        cases["odd grid"] = ((dataclasses.replace(image, grid_thw=(1, 3, 4)),), "multiples of 2")
    return cases


def test_a_bad_image_refuses_its_sequence_only(family_dir):
    family, directory = family_dir
    ids, (image,), _ = _prompt(directory, family, [_image(7, 56, 56)])
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=4)
    tables = BlockTables(runner)

    def good(seq_id: int):
        return dataclasses.replace(tables.feed(seq_id, ids, 0, True, GREEDY), images=(image,))

    alone = runner.step([good(1)]).tokens
    runner.step([], release_seq_ids=[1])
    tables.release(1)
    for name, (images, message) in _spoiled(family, image).items():
        bad = dataclasses.replace(tables.feed(2, ids, 0, True, GREEDY), images=images)
        result = runner.step([bad, good(1)])
        assert result.tokens == alone, name
        assert [r.seq_id for r in result.refused] == [2], name
        assert message in result.refused[0].message, (name, result.refused[0].message)
        assert 2 not in runner.sequences
        runner.step([], release_seq_ids=[1, 2])
        tables.release(1)
        tables.release(2)


def test_images_of_a_later_chunk_are_checked_on_that_chunk(family_dir):
    """A sequence admitted with a good first chunk whose next chunk reaches its image
    without pixels is refused then, and forgotten; its mate goes on."""
    family, directory = family_dir
    ids, (image,), _ = _prompt(directory, family, [_image(8, 56, 56)])
    runner = ModelRunner(directory, select_platform("cpu"), "float32", block_size=4, kv_cache_bytes=2**20,
                         max_batch_size=4)
    tables = BlockTables(runner)
    no_pixels = dataclasses.replace(image, pixel_values=None)
    head = dataclasses.replace(tables.feed(2, ids[:image.offset], 0, False, GREEDY), images=(no_pixels,))
    text = tables.feed(3, ids[:5], 0, True, GREEDY)
    assert not runner.step([head, text]).refused  # the image is not reached yet
    result = runner.step([tables.feed(2, ids[image.offset:], image.offset, True),
                          tables.feed(3, [text.token_ids[0]], 5, True)])
    assert [t.seq_id for t in result.tokens] == [3]
    assert [r.seq_id for r in result.refused] == [2] and "without pixels" in result.refused[0].message
    assert 2 not in runner.sequences and 3 in runner.sequences
    assert torch.is_tensor(image.pixel_values)
