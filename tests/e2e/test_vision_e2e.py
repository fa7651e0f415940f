"""Vision-language models through the whole chain with the `openai` client:
one chain per family (a tiny random-weight model, float32, 4-token KV blocks),
images as data URIs, from the local media directory and from an HTTP server
on loopback (the chain allows 127.0.0.1/32 for it), two images in one message,
the prefix cache keyed by image content, choices forked from a prompt with an
image, and refused parts (a video, a bad data URI) as the documented 422 with
the chain still serving.

Random weights give no meaningful text, so the checks are on what the model
saw: greedy log-probabilities are the same whichever way the same image
arrives and differ for another image, `usage.prompt_tokens` counts the image
tokens, and `cached_tokens` shows which KV blocks were reused."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor

from tests.e2e.conftest import load_reader, running_chain
from tests.vlm_models import LLAVA_TOKENS_PER_IMAGE, build_vlm

BLOCK_SIZE = 4
# Long enough that several full KV blocks come before the image.
SYSTEM = "You describe pictures in one short sentence, plainly and without guessing."


def _png(seed: int, width: int, height: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


IMAGES = {"a": _png(1, 100, 70), "b": _png(2, 60, 90), "c": _png(3, 80, 80)}


# Qwen2.5-VL shares Qwen2-VL's path in front and its positions; its tower is held to
# transformers in the worker's unit tests.
@pytest.fixture(scope="module", params=("llava", "qwen2_vl"))
def vlm(request, tmp_path_factory):
    """(family, model dir, openai client, scheduler stub, media dir, HTTP base URL) of a running chain."""
    from openai import OpenAI

    family = request.param
    model_dir = build_vlm(family, tmp_path_factory.mktemp(f"model-{family}"))
    media_dir = tmp_path_factory.mktemp(f"media-{family}")
    for name, data in IMAGES.items():
        (media_dir / f"{name}.png").write_bytes(data)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(media_dir))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"STORMSERVE_MODEL_PATH": str(model_dir), "STORMSERVE_DTYPE": "float32",
           "STORMSERVE_CACHE_BLOCK_SIZE": str(BLOCK_SIZE), "STORMSERVE_KV_CACHE_MIB": "64",
           "STORMSERVE_MEDIA_DIR": str(media_dir), "STORMSERVE_MEDIA_ALLOWED_NETWORKS": "127.0.0.1/32"}
    try:
        with running_chain(tmp_path_factory.mktemp(f"chain-{family}"), env=env) as (chain, stub):
            client = OpenAI(base_url=chain.url + "/v1", api_key="unused", timeout=120, max_retries=0)
            yield family, model_dir, client, stub, media_dir, f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _data_uri(name: str) -> str:
    return "data:image/png;base64," + base64.b64encode(IMAGES[name]).decode()


def _ask(client, *urls: str, question: str = "What is in this picture?"):
    content = [{"type": "text", "text": question}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return client.chat.completions.create(
        model=client.models.list().data[0].id, temperature=0, max_tokens=3, logprobs=True, top_logprobs=3,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
    )


def _logprobs(completion) -> list[list[tuple[str, float]]]:
    return [[(t.token, round(t.logprob, 4)) for t in entry.top_logprobs]
            for entry in completion.choices[0].logprobs.content]


def _num_image_tokens(family: str, model_dir, name: str) -> int:
    """The tokens an image adds to the prompt: its embeddings, and Qwen2-VL's two markers around them."""
    if family == "llava":
        return LLAVA_TOKENS_PER_IMAGE
    grid = AutoImageProcessor.from_pretrained(model_dir)(
        images=[Image.open(io.BytesIO(IMAGES[name]))], return_tensors="np")["image_grid_thw"][0]
    return int(grid.prod()) // 4 + 2


def test_the_same_image_from_every_source_is_the_same_prompt(vlm):
    family, model_dir, client, _, media_dir, http_base = vlm
    text_only = _ask(client)
    by_data_uri = _ask(client, _data_uri("a"))
    by_path = _ask(client, f"{media_dir}/a.png")
    by_http = _ask(client, f"{http_base}/a.png")
    assert _logprobs(by_data_uri) == _logprobs(by_path) == _logprobs(by_http)
    assert _logprobs(_ask(client, _data_uri("b"))) != _logprobs(by_data_uri)
    for completion in (by_data_uri, by_path, by_http):
        assert completion.usage.prompt_tokens == text_only.usage.prompt_tokens + _num_image_tokens(
            family, model_dir, "a")


def test_two_images_in_one_message(vlm):
    family, model_dir, client, _, _, _ = vlm
    text_only = _ask(client)
    both = _ask(client, _data_uri("a"), _data_uri("c"))
    assert both.usage.prompt_tokens == text_only.usage.prompt_tokens + sum(
        _num_image_tokens(family, model_dir, name) for name in ("a", "c"))
    assert _logprobs(both) != _logprobs(_ask(client, _data_uri("a")))
    assert _logprobs(both) != _logprobs(_ask(client, _data_uri("c"), _data_uri("a")))


def test_prefix_cache_reuses_an_image_only_for_the_same_image(vlm):
    family, model_dir, client, stub, _, _ = vlm
    question = "Which colours are in this picture, in order?"
    load = load_reader(stub)
    first = _ask(client, _data_uri("a"), question=question)
    cached_before = load().workers[0].num_cached_tokens
    other = _ask(client, _data_uri("b"), question=question)
    same = _ask(client, _data_uri("a"), question=question)
    image_tokens = _num_image_tokens(family, model_dir, "a")
    # The same image: every full block, the image's included, comes from the cache...
    assert same.usage.prompt_tokens_details.cached_tokens >= same.usage.prompt_tokens - BLOCK_SIZE
    # ...with the KV the first request computed: the same answer.
    assert _logprobs(same) == _logprobs(first)
    # Another image after the same text: the text before it is reused, its own blocks are not.
    assert other.usage.prompt_tokens_details.cached_tokens <= other.usage.prompt_tokens - image_tokens
    assert _logprobs(other) != _logprobs(first)
    # Asked again, the other image now hits the blocks it computed, and its answer stands.
    assert _logprobs(_ask(client, _data_uri("b"), question=question)) == _logprobs(other)
    assert load().workers[0].num_cached_tokens > cached_before


def test_refused_parts_get_the_documented_422(vlm):
    _, _, client, _, _, _ = vlm
    from openai import UnprocessableEntityError

    model = client.models.list().data[0].id
    for part, reason in (
        ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "video_url and audio_url"),
        ({"type": "image_url", "image_url": {"url": "data:image/png;base64,not base64!"}}, "messages[0].content[1]"),
    ):
        with pytest.raises(UnprocessableEntityError) as refused:
            client.chat.completions.create(model=model, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}])
        body = refused.value.response.json()
        assert body["error_type"] == "Input Validation Error" and body["code"] == 422 and reason in body["error"]
    assert _ask(client, _data_uri("a")).choices[0].finish_reason == "length"  # still serving


def test_choices_share_the_prompt_with_its_image(vlm):
    """n = 2: the siblings fork from the first sequence's prompt blocks, so their
    image reaches the worker without pixels; each choice's first token comes
    from the same distribution as a single answer's."""
    _, _, client, _, _, _ = vlm
    content = [{"type": "text", "text": "Two answers, please."},
               {"type": "image_url", "image_url": {"url": _data_uri("c")}}]

    def first_token_logprobs(n: int):
        completion = client.chat.completions.create(
            model=client.models.list().data[0].id, temperature=1, seed=5, max_tokens=2, logprobs=True,
            top_logprobs=3, n=n, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}])
        return completion, [[(t.token, round(t.logprob, 4)) for t in choice.logprobs.content[0].top_logprobs]
                            for choice in completion.choices]

    single, (expected,) = first_token_logprobs(1)
    both, choices = first_token_logprobs(2)
    assert choices == [expected, expected] and both.usage.prompt_tokens == single.usage.prompt_tokens
