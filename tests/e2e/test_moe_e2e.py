"""The whole chain on tiny random-weight models of the MoE families, built at
test time (tests/moe_models.py): DeepSeek-V3 with an R1-style template (MLA
over the latent pool, group-limited MoE) and Qwen3-MoE. The scheduler's greedy
tokens equal transformers' own generate() on the same weights; the tokenizer
detects each family's tool and reasoning formats, and a forced tool call comes
back parsed in the family's format through the openai client."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from stormserve.scheduler.v1 import scheduler_pb2
from tests.e2e.conftest import running_chain, scrape, total
from tests.moe_models import build_moe

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    # An enum: a random model's free string would run to max_tokens.
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
FORMATS = {"deepseek_v3": "tool format deepseek_v3; reasoning True", "qwen3_moe": "tool format hermes; reasoning True"}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def moe_chain(request, tmp_path_factory):
    family = request.param
    model_dir = build_moe(family, tmp_path_factory.mktemp(f"{family}-model"))
    logs = tmp_path_factory.mktemp(f"{family}-chain")
    env = {"STORMSERVE_MODEL_PATH": str(model_dir), "STORMSERVE_MODEL_NAME": f"tiny-{family}",
           "STORMSERVE_DTYPE": "float32", "STORMSERVE_KV_CACHE_MIB": "64"}
    with running_chain(logs, env=env) as (chain, stub):
        yield family, model_dir, chain, stub, logs


def assert_greedy_tokens(model_dir, stub, prompt: list[int], n: int, request_id: str) -> None:
    """The scheduler's greedy tokens for `prompt` are transformers' eager float32 generate()'s."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        expected = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False)[0, len(prompt):].tolist()
    request = scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=scheduler_pb2.SamplingParams(temperature=0.0),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=n, ignore_eos=True))
    produced = [t.token_id for reply in stub.Generate(request, timeout=120) for t in reply.tokens]
    assert produced == expected


def test_the_chain_serves_transformers_greedy_tokens(moe_chain):
    family, model_dir, _, stub, logs = moe_chain
    assert "lean path" in (logs / "worker0.log").read_text()
    assert_greedy_tokens(model_dir, stub, list(range(300, 331)), 16, f"{family}-greedy")


def test_the_familys_formats_are_detected_and_a_forced_call_is_parsed(moe_chain):
    from openai import OpenAI

    family, model_dir, chain, _, logs = moe_chain
    assert FORMATS[family] in (logs / "tokenizer.log").read_text()
    client = OpenAI(base_url=chain.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    # The think block is closed by a spent budget, then the grammar forces the call.
    reply = client.chat.completions.create(
        model=f"tiny-{family}", messages=[{"role": "user", "content": "Weather in Paris?"}], temperature=0,
        max_tokens=200, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template_kwargs": {"thinking_budget": 3}})
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls", message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert message.reasoning_content  # the reasoning before the budget closed it
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert "<think>" in tokenizer.chat_template


@pytest.fixture(scope="module")
def mtp_chain(tmp_path_factory):
    model_dir = build_moe("deepseek_v3", tmp_path_factory.mktemp("deepseek-mtp-model"), mtp=True)
    env = {"STORMSERVE_MODEL_PATH": str(model_dir), "STORMSERVE_MODEL_NAME": "tiny-r1-mtp",
           "STORMSERVE_DTYPE": "float32", "STORMSERVE_KV_CACHE_MIB": "64", "STORMSERVE_SPECULATIVE_METHOD": "mtp"}
    with running_chain(tmp_path_factory.mktemp("deepseek-mtp-chain"), env=env) as (chain, stub):
        yield model_dir, chain, stub


def test_mtp_drafts_ride_the_chain_and_change_no_token(mtp_chain):
    model_dir, chain, stub = mtp_chain
    assert_greedy_tokens(model_dir, stub, list(range(500, 537)), 24, "mtp-greedy")
    drafts = total(scrape(chain.metrics_urls["scheduler"])[1], "vllm:spec_decode_num_draft_tokens_total")
    # The worker's drafts reached the scheduler and were verified: steps carried them
    # until the random module's misses paused drafting (speculation.py).
    assert drafts >= 3
