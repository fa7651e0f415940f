"""Image parts in front: what the chat template sees, each placeholder
expanded to the image tokens of the model's own image processor, and the
parts a model cannot use refused before anything is fetched."""
from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from PIL import Image
from transformers import AutoConfig, AutoTokenizer

from services.common.errors import ServiceError
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.media import MediaItem, MediaRefused
from services.tokenizer.multimodal import ImageProcessor
from services.tokenizer.prompt import PromptBuilder
from services.tokenizer.template import media_parts, message_to_dict
from stormserve.chat.v1 import chat_pb2
from tests.unit.tokenizer.media_fixtures import body, http_server, mp4, png
from tests.vlm_models import FAMILIES, LLAVA_TOKENS_PER_IMAGE, build_vlm


def _message(*parts: tuple[str, str]) -> chat_pb2.ChatMessage:
    message = chat_pb2.ChatMessage(role="user")
    for kind, value in parts:
        part = message.content_parts.add(type=kind)
        if kind == "text":
            part.text = value
        else:
            getattr(part, kind).url = value
    return message


def _item(width: int, height: int) -> MediaItem:
    image = Image.fromarray(np.full((height, width, 3), 200, dtype=np.uint8))
    data = image.tobytes()
    return MediaItem(kind="image", data=data, format="png", sha256=hashlib.sha256(data).hexdigest(), image=image)


def test_parts_a_model_cannot_use_are_refused_without_fetching_them(tmp_path):
    """A text-only model refuses every media part, a vision model video and
    audio, before any fetch: a server that cannot use media never reaches out
    for it. The fetch could reach the test server (its address is allowed),
    as the image the vision model takes shows."""
    directory = build_vlm("llava", tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    config = TokenizerConfig(media_allowed_networks=("127.0.0.1/32",))
    text_only = PromptBuilder(config, tokenizer, max_input_tokens=2048)
    vision = PromptBuilder(config, tokenizer, max_input_tokens=2048,
                           images=ImageProcessor(directory, AutoConfig.from_pretrained(directory)))

    async def scenario() -> None:
        async with http_server({"/a.png": body(png()), "/v.mp4": body(mp4(1))}) as server:
            image = _message(("text", "what is this?"), ("image_url", server.url("/a.png")))
            video = _message(("text", "and this?"), ("video_url", server.url("/v.mp4")))
            with pytest.raises(ServiceError, match="accepts text only") as caught:
                await text_only.render([image], [], {})
            assert not isinstance(caught.value, MediaRefused) and caught.value.error_reason == ""
            with pytest.raises(ServiceError, match="video_url and audio_url parts are not supported"):
                await vision.render([video], [], {})
            assert server.requests == []
            prompt = await vision.render([image], [], {})
            assert [path for path, _ in server.requests] == ["/a.png"] and len(prompt.images) == 1

    try:
        asyncio.run(scenario())
    finally:
        text_only.close()
        vision.close()


def test_a_vision_model_sees_image_parts_and_refuses_video_and_audio():
    message = _message(("text", "compare"), ("image_url", "/data/multimodal_inputs/a.png"), ("text", "and"),
                       ("image_url", "http://example.com/b.png"))
    assert message_to_dict(message, accepts_images=True)["content"] == [
        {"type": "text", "text": "compare"}, {"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]
    assert media_parts([_message(("text", "x")), message]) == [
        ("image", "/data/multimodal_inputs/a.png", "messages[1].content[1].image_url"),
        ("image", "http://example.com/b.png", "messages[1].content[3].image_url")]
    with pytest.raises(ServiceError, match="video_url and audio_url"):
        message_to_dict(_message(("video_url", "/data/multimodal_inputs/v.mp4")), accepts_images=True)
    # Text-only messages keep their plain string content.
    assert message_to_dict(_message(("text", "a"), ("text", "b")), accepts_images=True)["content"] == "ab"


@pytest.mark.parametrize("family", FAMILIES)
def test_placeholders_expand_to_each_images_tokens(family, tmp_path):
    directory = build_vlm(family, tmp_path)
    config = AutoConfig.from_pretrained(directory)
    processor = ImageProcessor(directory, config)
    placeholder = config.image_token_id
    prompt = [5, placeholder, 6, 7, placeholder, 8]
    small, large = _item(56, 56), _item(112, 84)
    token_ids, images = processor.expand(prompt, [small, large])
    # Qwen2-VL: one token per 2 x 2 merged 14-pixel patches; LLaVA: one per patch of its 56 x 56 crop.
    sizes = (1 * 4 * 4 // 4, 1 * 6 * 8 // 4) if family != "llava" else (LLAVA_TOKENS_PER_IMAGE,) * 2
    assert [(i.offset, i.num_tokens) for i in images] == [(1, sizes[0]), (3 + sizes[0], sizes[1])]
    assert token_ids == [5] + [placeholder] * sizes[0] + [6, 7] + [placeholder] * sizes[1] + [8]
    assert images[0].content_hash == bytes.fromhex(small.sha256)
    assert all(i.pixel_values.dtype == np.float32 for i in images)
    if family != "llava":
        assert [i.grid_thw for i in images] == [(1, 4, 4), (1, 6, 8)]
        assert images[1].pixel_values.shape == (48, 3 * 2 * 14 * 14)
    else:
        assert images[1].pixel_values.shape == (3, 56, 56)
    with pytest.raises(ServiceError, match="2 image placeholders for 1 images"):
        processor.expand(prompt, [small])


def test_an_unknown_vision_family_is_refused_at_start(tmp_path):
    config = AutoConfig.from_pretrained(build_vlm("llava", tmp_path))
    config.model_type = "idefics3"  # a vision-language family not served
    with pytest.raises(ValueError, match="not supported"):
        ImageProcessor(tmp_path, config)


def test_a_request_whose_pixels_exceed_one_step_is_refused_with_413(tmp_path, monkeypatch):
    directory = build_vlm("llava", tmp_path)
    processor = ImageProcessor(directory, AutoConfig.from_pretrained(directory))
    placeholder = processor.image_token_id
    one_image = 3 * 56 * 56 * 4  # float32 pixels of LLaVA's 56 x 56 crop
    monkeypatch.setattr("services.tokenizer.multimodal.MAX_STEP_IMAGE_BYTES", 2 * one_image)
    processor.expand([placeholder, placeholder], [_item(56, 56), _item(60, 60)])
    with pytest.raises(MediaRefused) as refused:
        processor.expand([placeholder] * 3, [_item(56, 56)] * 3)
    assert refused.value.status == 413 and refused.value.where == "messages"
