"""The documented reply shapes (schemas.py, served in /openapi.json) against
real replies of the chain: every key a reply carries must be modelled, so the
document cannot drift from what clients get."""
from __future__ import annotations

import httpx
import pytest

from services.http_edge.schemas import ChatCompletion, ChatCompletionChunk, ErrorBody, ModelCard, ModelList
from tests.e2e.conftest import MODEL
from tests.e2e.test_api_e2e import stream_chunks

ASK = [{"role": "system", "content": "Reply with one word."}, {"role": "user", "content": "Name a colour."}]
PING = {"type": "function", "function": {"name": "ping", "description": "Check the line.",
                                         "parameters": {"type": "object", "properties": {}}}}
VARIANTS = {
    "plain": {},
    "logprobs": {"logprobs": True, "top_logprobs": 2},
    "tool call": {"tools": [PING], "tool_choice": {"type": "function", "function": {"name": "ping"}},
                  "max_tokens": 30},
    "stop string": {"stop": ["e"], "include_stop_str_in_output": True},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_replies_match_the_documented_models(base_url, variant):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, "temperature": 0, **VARIANTS[variant]}
    reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    completion = ChatCompletion.model_validate(reply.json())
    fingerprint = completion.system_fingerprint
    assert fingerprint.startswith("fp_")

    chunks = stream_chunks(base_url, {**body, "stream_options": {"include_usage": True}})
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert {c["system_fingerprint"] for c in chunks} == {fingerprint}  # the usage-only chunk too
    assert chunks[-1]["choices"] == []
    if variant == "tool call":
        assert completion.choices[0].message.tool_calls
        assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
    if variant == "logprobs":
        assert completion.choices[0].logprobs and completion.choices[0].logprobs.content


def test_models_errors_and_the_document_match(base_url):
    listed = ModelList.model_validate(httpx.get(base_url + "/v1/models", timeout=30).json())
    assert [m.id for m in listed.data] == [MODEL]
    ModelCard.model_validate(httpx.get(f"{base_url}/v1/models/{MODEL}", timeout=30).json())
    missing = httpx.get(base_url + "/v1/models/nope", timeout=30)
    assert missing.status_code == 404
    ErrorBody.model_validate(missing.json())
    refused = httpx.post(base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []}, timeout=30)
    assert refused.status_code == 422
    ErrorBody.model_validate(refused.json())

    doc = httpx.get(base_url + "/openapi.json", timeout=30).json()
    assert set(doc["components"]["schemas"]) >= {"ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk"}
    assert httpx.get(base_url + "/docs", timeout=30).status_code == 200
