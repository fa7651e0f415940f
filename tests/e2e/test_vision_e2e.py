"""Vision-language models through the whole chain with the `openai` client:
one chain per family (a tiny random-weight model, float32, 4-token KV blocks),
images as data URIs, from the local media directory and from an HTTP server
on loopback (the chain allows 127.0.0.2/32 for it, and no other loopback
address), two images in one message, the prefix cache keyed by image content,
choices forked from a prompt with an image, and refused parts as the
documented 4xx with the chain still serving: a video, the SSRF and abuse
cases of docs/operating/media-fetching.md (addresses, redirects, names, symlinks, part count,
decompression bombs, sizes, a silent server, bad data URIs), and any media
part sent to the bundled text-only model.

Random weights give no meaningful text, so the checks are on what the model
saw: greedy log-probabilities are the same whichever way the same image
arrives and differ for another image, `usage.prompt_tokens` counts the image
tokens, and `cached_tokens` shows which KV blocks were reused."""
from __future__ import annotations

import base64
import functools
import http.server
import io
import socket
import threading
import urllib.parse

import httpx
import numpy as np
import pytest
from PIL import Image
from transformers import AutoImageProcessor

from tests.e2e.conftest import MODEL, load_reader, running_chain
from tests.unit.tokenizer.media_fixtures import data_uri, png_claiming
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
# The media server's loopback address, the one the chain allows: 127.0.0.1 (where
# the chain itself listens, and where "localhost" resolves) and ::1 stay refused.
MEDIA_HOST = "127.0.0.2"
MAX_ITEM_MIB = 1  # STORMSERVE_MAX_REQUEST_MIB: an item over it is refused with 413
READ_TIMEOUT_S = 2  # STORMSERVE_MEDIA_READ_TIMEOUT_S: how long a silent media server is waited for


class _MediaHandler(http.server.SimpleHTTPRequestHandler):
    """Serves the media directory, and /redirect?to=<url> as a 302 to that URL."""

    def do_GET(self):
        path, _, query = self.path.partition("?")
        if path != "/redirect":
            return super().do_GET()
        self.send_response(302)
        self.send_header("Location", urllib.parse.parse_qs(query)["to"][0])
        self.send_header("Content-Length", "0")
        self.end_headers()


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
    handler = functools.partial(_MediaHandler, directory=str(media_dir))
    server = http.server.ThreadingHTTPServer((MEDIA_HOST, 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {"STORMSERVE_MODEL_PATH": str(model_dir), "STORMSERVE_DTYPE": "float32",
           "STORMSERVE_CACHE_BLOCK_SIZE": str(BLOCK_SIZE), "STORMSERVE_KV_CACHE_MIB": "64",
           "STORMSERVE_MEDIA_DIR": str(media_dir), "STORMSERVE_MEDIA_ALLOWED_NETWORKS": f"{MEDIA_HOST}/32",
           "STORMSERVE_MAX_REQUEST_MIB": str(MAX_ITEM_MIB), "STORMSERVE_MEDIA_READ_TIMEOUT_S": str(READ_TIMEOUT_S)}
    try:
        with running_chain(tmp_path_factory.mktemp(f"chain-{family}"), env=env) as (chain, stub):
            client = OpenAI(base_url=chain.url + "/v1", api_key="unused", timeout=120, max_retries=0)
            yield family, model_dir, client, stub, media_dir, f"http://{MEDIA_HOST}:{server.server_port}"
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


def _post(base_url, content: list[dict]) -> httpx.Response:
    """A chat request of one user message with `content`, as raw HTTP through the edge."""
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    return httpx.post(f"{str(base_url).rstrip('/')}/chat/completions", json=body, timeout=120)


def _expect_refusal(response: httpx.Response, status: int, where: str, words: str) -> None:
    """The documented error body, its message naming the part (`where`: the part,
    or "messages" for the edge's rule on the whole list) and the reason."""
    body = response.json()
    assert response.status_code == status, body
    error_type = {422: "Input Validation Error", 413: "Payload Too Large"}[status]
    assert body == {"error": body["message"], "error_type": error_type, "code": status, "result": None,
                    "message": body["message"]}
    assert body["message"].startswith(where) and words in body["message"], body["message"]


def test_a_video_part_gets_the_documented_422(vlm):
    _, _, client, _, _, _ = vlm
    from openai import UnprocessableEntityError

    with pytest.raises(UnprocessableEntityError) as refused:
        client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Look:"},
                                         {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}])
    body = refused.value.response.json()
    assert body["error_type"] == "Input Validation Error" and body["code"] == 422
    assert "video_url and audio_url parts are not supported" in body["error"]
    assert _ask(client, _data_uri("a")).choices[0].finish_reason == "length"  # still serving


def test_ssrf_and_abusive_parts_are_refused_through_the_chain(vlm, tmp_path):
    """docs/operating/media-fetching.md's cases, each as a client sees it through the edge: a 4xx
    with the documented body naming the part and the reason, never a 5xx; the
    chain serves on."""
    _, _, client, _, media_dir, http_base = vlm
    (tmp_path / "secret.png").write_bytes(IMAGES["a"])
    (media_dir / "escape.png").unlink(missing_ok=True)
    (media_dir / "escape.png").symlink_to(tmp_path / "secret.png")
    cap = MAX_ITEM_MIB * 2**20
    (media_dir / "big.png").write_bytes(b"\x89PNG\r\n\x1a\n".ljust(cap + 1, b"\0"))
    silent = socket.create_server((MEDIA_HOST, 0))  # takes connections into its backlog and never answers
    media_port, edge_port = urllib.parse.urlsplit(http_base).port, client.base_url.port
    where = "messages[0].content[1].image_url: "
    cases = [
        ("http://10.0.0.1/a.png", 422, "resolves to a non-public address (10.0.0.1)"),
        ("http://169.254.169.254/latest/meta-data/", 422, "resolves to a non-public address (169.254.169.254)"),
        (f"http://127.0.0.1:{edge_port}/v1/models", 422, "resolves to a non-public address (127.0.0.1)"),
        (f"http://[::1]:{media_port}/a.png", 422, "resolves to a non-public address (::1)"),
        (f"http://localhost:{media_port}/a.png", 422, "the host localhost resolves to a non-public address"),
        (f"{http_base}/redirect?to=http://169.254.169.254/latest/meta-data/", 422,
         "the host 169.254.169.254 resolves to a non-public address"),
        (f"{http_base}/redirect?to=http://127.0.0.1:{edge_port}/v1/models", 422,
         "the host 127.0.0.1 resolves to a non-public address"),
        (f"{media_dir}/escape.png", 422, "symlinks are not followed"),
        (data_uri("image/png", png_claiming(100_000, 100_000)), 422, "(a decompression bomb)"),
        (f"{media_dir}/big.png", 413, f"the image is {cap + 1} bytes, more than the {cap} allowed"),
        (f"http://{MEDIA_HOST}:{silent.getsockname()[1]}/a.png", 422, "the media server timed out (ReadTimeout)"),
        ("data:image/png;base64,not base64!", 422, "the data URI's base64 payload is malformed"),
    ]
    try:
        for url, status, words in cases:
            response = _post(client.base_url, [{"type": "text", "text": "Look:"},
                                               {"type": "image_url", "image_url": {"url": url}}])
            _expect_refusal(response, status, where, words)
    finally:
        silent.close()
    parts = [{"type": "image_url", "image_url": {"url": f"{media_dir}/a.png"}}] * 21
    _expect_refusal(_post(client.base_url, parts), 422, "messages ", "may hold at most 20 media parts, got 21")
    assert _ask(client, f"{http_base}/a.png").choices[0].finish_reason == "length"  # still serving


def test_a_text_only_model_refuses_any_media_part(base_url):
    """The bundled model has no vision tower: the documented 422, before any fetch."""
    response = _post(base_url + "/v1", [{"type": "text", "text": "What is this?"},
                                        {"type": "image_url", "image_url": {"url": _data_uri("a")}}])
    message = "this model accepts text only; media content parts are not supported"
    assert response.status_code == 422
    assert response.json() == {"error": message, "error_type": "Input Validation Error", "code": 422,
                               "result": None, "message": message}


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
