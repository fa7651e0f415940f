"""The whole chain on the real model, through the official openai client and raw HTTP."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import MODEL, aborted_requests, wait_until_idle

QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


def parse_sse(body: bytes) -> list[str]:
    """Split an SSE body into its data payloads, checking the framing byte for byte."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    events = body.split(b"\n\n")
    assert events[-1] == b"", "the body must end with a blank-line separator"
    payloads = []
    for event in events[:-1]:
        assert event.startswith(b"data: "), event[:80]
        assert b"\n" not in event, "one data line per event, no other fields"
        payloads.append(event[len(b"data: "):].decode())
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    return payloads[:-1]


def test_models_and_health(base_url):
    assert httpx.get(base_url + "/health").status_code == 200
    models = httpx.get(base_url + "/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_non_stream_shape_and_statistics(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.index == 0 and choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    usage = reply.usage
    assert usage.prompt_tokens > 5 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Earlier requests share the template's system prompt, so part of it may be cached.
    assert 0 <= usage.prompt_tokens_details.cached_tokens < usage.prompt_tokens
    extra = reply.model_extra
    assert len(usage.model_extra["batch_size"]) == usage.completion_tokens
    assert len(usage.model_extra["queue_wait_time"]) == usage.completion_tokens
    assert all(b >= 1 for b in usage.model_extra["batch_size"])
    assert extra["prefill_time"] > 0
    assert len(extra["decode_time_arr"]) == usage.completion_tokens - 1


def test_stream_framing_byte_for_byte(base_url):
    request = {"model": MODEL, "messages": QUESTION, "stream": True, "temperature": 0, "max_tokens": 20}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=request, timeout=120) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        body = b"".join(response.iter_bytes())
    chunks = [json.loads(p) for p in parse_sse(body)]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1 and len({c["created"] for c in chunks}) == 1
    for chunk in chunks[:-1]:
        assert chunk["choices"][0]["finish_reason"] is None and "usage" not in chunk
        assert chunk["choices"][0]["delta"]["role"] == "assistant"
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("stop", "length")
    usage = last["usage"]
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
    assert len(usage["batch_size"]) == len(usage["queue_wait_time"]) == usage["completion_tokens"]


def test_stream_equals_non_stream_under_greedy(openai_client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=25)
    full = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    stream = openai_client.chat.completions.create(stream=True, **kwargs)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full


def test_greedy_is_deterministic(openai_client):
    outputs = {
        openai_client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0,
                                              max_tokens=30).choices[0].message.content
        for _ in range(2)
    }
    assert len(outputs) == 1


def test_seed_reproduces_and_differs_across_seeds(openai_client):
    def sample(seed):
        return openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a short story."}],
            temperature=1.0, top_p=0.95, seed=seed, max_tokens=30, extra_body={"top_k": 50},
        ).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_max_tokens_gives_length(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count from 1 to 100."}], max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_eight_concurrent_streams_all_complete(openai_client):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    def run(prompt):
        stream = openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], stream=True, max_tokens=40,
            temperature=0, extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, prompts))
    for text, last in results:
        assert text.strip()
        assert last.choices[0].finish_reason == "length"
        assert last.usage.completion_tokens == 40
    batch_sizes = [b for _, last in results for b in last.usage.model_extra["batch_size"]]
    assert max(batch_sizes) > 1, "concurrent requests must share engine steps"


@pytest.mark.parametrize(
    "body, status",
    [
        ({"model": MODEL, "messages": QUESTION, "temperature": 3}, 422),
        ({"model": MODEL, "messages": QUESTION, "top_p": 0}, 422),
        ({"model": MODEL, "messages": QUESTION, "max_tokens": 0}, 422),
        ({"model": MODEL, "messages": []}, 422),
        ({"model": MODEL}, 422),
        ({"messages": QUESTION}, 422),
        ({"model": "no-such-model", "messages": QUESTION}, 422),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 424),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}], "stream": True}, 424),
    ],
)
def test_bad_inputs_get_4xx_with_error_body(base_url, body, status):
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["result"] is None and error["message"] and error["error"] and error["error_type"]
    assert isinstance(error["code"], int)


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_bodies_get_422(base_url, raw):
    response = httpx.post(base_url + "/v1/chat/completions", content=raw,
                          headers={"Content-Type": "application/json"}, timeout=30)
    assert response.status_code == 422, response.text


def test_documented_curl_request_verbatim(base_url):
    """The request from the API page, headers included, with our model name."""
    headers = {
        "Authorization": "Bearer {ApiKey}",
        "Content-Type": "application/json",
        "Accept": "*/*",
        "Host": "api.siliconstorm.ai",
        "Connection": "keep-alive",
    }
    for stream in (True, False):
        body = json.dumps({"model": MODEL, "messages": [
            {"content": "Write a helloword and explain the code", "role": "user"}], "stream": stream})
        response = httpx.post(base_url + "/v1/chat/completions", content=body, headers=headers, timeout=300)
        assert response.status_code == 200, response.text
        if stream:
            assert json.loads(parse_sse(response.content)[-1])["choices"][0]["finish_reason"]
        else:
            assert response.json()["choices"][0]["message"]["content"]


def test_disconnect_mid_stream_frees_the_sequence(chain, base_url, scheduler_load, openai_client):
    aborted = aborted_requests(chain)
    request = {"model": MODEL, "messages": QUESTION, "stream": True, "max_tokens": 400, "ignore_eos": True}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=request, timeout=120) as response:
        lines = response.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
        load = scheduler_load()
        assert load.num_running + load.num_waiting >= 1
    # Closing the response drops the connection: the sequence must leave the scheduler,
    # cancelled (a sequence that ran its 400 tokens would leave it as well, by length).
    load = wait_until_idle(scheduler_load)
    assert (load.num_running, load.num_waiting) == (0, 0)
    assert aborted_requests(chain) == aborted + 1
    assert httpx.get(base_url + "/health").status_code == 200
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5)
    assert reply.choices[0].message.content is not None


def test_stop_string_cuts_exactly(openai_client):
    kwargs = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=30)
    full = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    assert "Paris" in full
    reply = openai_client.chat.completions.create(stop=["Paris"], **kwargs)
    assert reply.choices[0].message.content == full[: full.index("Paris")]
    assert reply.choices[0].finish_reason == "stop"


def test_repetition_penalty_changes_greedy_output(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "List the colors of the rainbow."}],
                  temperature=0, max_tokens=40)
    plain = openai_client.chat.completions.create(**kwargs).choices[0].message.content
    penalized = openai_client.chat.completions.create(
        extra_body={"repetition_penalty": 1.8}, **kwargs).choices[0].message.content
    assert plain != penalized


def test_logprobs_are_returned_per_token(openai_client):
    reply = openai_client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8,
                                                  logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens or len(entries) == reply.usage.completion_tokens - 1
    for entry in entries:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob >= max(t.logprob for t in entry.top_logprobs) - 1e-4


def test_json_object_output_parses(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What color is the sky? Answer as JSON."}],
        max_tokens=300, temperature=0, response_format={"type": "json_object"},
        extra_body={"repetition_penalty": 1.3},  # greedy SmolLM2 otherwise loops inside a string
    )
    assert reply.choices[0].finish_reason == "stop", reply.choices[0].message.content
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_json_schema_output_validates(openai_client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0},
                       "species": {"enum": ["cat", "dog"]}},
        "required": ["name", "age", "species"],
        "additionalProperties": False,
    }
    for stream in (False, True):
        kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Invent a pet."}], max_tokens=120,
                      temperature=0.7, seed=7,
                      response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}})
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in
                           openai_client.chat.completions.create(stream=True, **kwargs) if c.choices)
        else:
            text = openai_client.chat.completions.create(**kwargs).choices[0].message.content
        value = json.loads(text)
        assert set(value) == {"name", "age", "species"}
        assert isinstance(value["name"], str) and len(value["name"]) <= 20
        assert isinstance(value["age"], int) and value["age"] >= 0 and value["species"] in ("cat", "dog")


def test_unenforceable_schema_is_422(base_url):
    body = {"model": MODEL, "messages": QUESTION, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 422, response.text


def test_n_choices_non_stream_and_stream(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=12,
                  temperature=1.0, seed=11, n=2)
    reply = openai_client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in reply.choices) == [0, 1]
    assert all(c.message.content and c.finish_reason in ("stop", "length") for c in reply.choices)
    assert reply.usage.completion_tokens > 0
    texts: dict[int, str] = {0: "", 1: ""}
    finishes = {}
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert set(finishes) == {0, 1} and all(texts.values())


def test_best_of_returns_n_choices(openai_client):
    reply = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_tokens=8, temperature=1.0,
        seed=5, n=1, extra_body={"best_of": 3})
    assert [c.index for c in reply.choices] == [0]
    assert reply.choices[0].message.content


def test_beam_search_of_width_one_is_greedy(openai_client):
    kwargs = dict(model=MODEL, messages=QUESTION, max_tokens=16)
    greedy = openai_client.chat.completions.create(temperature=0, **kwargs)
    beam = openai_client.chat.completions.create(extra_body={"use_beam_search": True}, **kwargs)
    assert beam.choices[0].message.content == greedy.choices[0].message.content
    assert beam.usage.completion_tokens == greedy.usage.completion_tokens


def test_beam_search_returns_the_n_best_whole_in_stream_and_not(openai_client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=12, n=2,
                  extra_body={"use_beam_search": True, "best_of": 3})
    reply = openai_client.chat.completions.create(**kwargs)
    assert [c.index for c in reply.choices] == [0, 1]
    texts = [c.message.content for c in reply.choices]
    assert all(texts) and texts[0] != texts[1]
    assert all(c.finish_reason in ("stop", "length") for c in reply.choices)
    streamed: dict[int, list[str]] = {0: [], 1: []}
    for chunk in openai_client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index].append(choice.delta.content or "")
    assert ["".join(parts) for parts in streamed.values()] == texts  # the same beams, sent when the search ends


@pytest.mark.parametrize("extra, message", [
    ({"stop": ["."], "max_tokens": 8}, "stop"),
    ({}, "max_tokens <= 128"),  # the default, maxIterTimes 512
    ({"max_tokens": 8, "presence_penalty": 0.5}, "presence_penalty"),
])
def test_beam_search_conflicts_are_422(base_url, extra, message):
    body = {"model": MODEL, "messages": QUESTION, "use_beam_search": True, **extra}
    response = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 422 and message in response.json()["message"], response.text


@pytest.mark.parametrize("spelling", ["prefix", "continue_final_message"])
def test_assistant_prefix_is_continued(base_url, spelling):
    messages = [{"role": "user", "content": "Which city is the capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    body = {"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 5}
    if spelling == "prefix":
        messages[-1]["prefix"] = True
    else:
        body["continue_final_message"] = True
    reply = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["message"]["content"].strip().startswith("Paris")


def test_continue_final_message_needs_an_assistant_message(base_url):
    body = {"model": MODEL, "messages": QUESTION, "continue_final_message": True}
    assert httpx.post(base_url + "/v1/chat/completions", json=body, timeout=60).status_code == 422
