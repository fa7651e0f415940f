"""Speculative decoding through the real chain: greedy outputs with drafts are
token for token those without, for grounded prompts (which copy their input, so
drafts are kept) and random ones (drafts mostly fail), alone and batched; and
the chain reports the drafts in its metrics. float32 on both chains, for exact
greedy text (see conftest)."""
from __future__ import annotations

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from transformers import AutoTokenizer

from bench.grounded import make_grounded_prompts
from bench.serve import make_prompts
from services.common.model_files import default_model_path, resolve_model
from stormserve.scheduler.v1 import scheduler_pb2
from tests.e2e.conftest import running_chain

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def speculative_chain(tmp_path_factory):
    env = {"STORMSERVE_DTYPE": "float32", "STORMSERVE_SPECULATIVE_METHOD": "suffix"}
    with running_chain(tmp_path_factory.mktemp("speculative"), env=env) as running:
        yield running


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(default_model_path()))
    texts = make_grounded_prompts(3, 100, seed=5) + make_prompts(2, 60, seed=5)
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                               return_dict=True)["input_ids"]) for t in texts]


def generate(stub, request_id: str, prompt: list[int]) -> list[int]:
    request = scheduler_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=prompt, sampling=scheduler_pb2.SamplingParams(temperature=0.0),
        stopping=scheduler_pb2.StoppingCriteria(max_tokens=MAX_TOKENS, ignore_eos=True))
    return [t.token_id for reply in stub.Generate(request, timeout=300) for t in reply.tokens]


def scheduler_counter(chain, name: str) -> float:
    text = urllib.request.urlopen(chain.metrics_urls["scheduler"], timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


def test_greedy_outputs_with_drafts_equal_those_without(chain_and_stub, speculative_chain, prompts):
    _, plain = chain_and_stub
    chain, drafting = speculative_chain
    expected = [generate(plain, f"plain-{i}", p) for i, p in enumerate(prompts)]
    alone = [generate(drafting, f"alone-{i}", p) for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(len(prompts)) as pool:  # batched: drafts beside other sequences' rows
        batched = list(pool.map(lambda ip: generate(drafting, f"batched-{ip[0]}", ip[1]), enumerate(prompts)))
    for i, want in enumerate(expected):
        assert len(want) == MAX_TOKENS
        assert alone[i] == want, f"prompt {i} alone"
        assert batched[i] == want, f"prompt {i} batched"
    drafted = scheduler_counter(chain, "vllm:spec_decode_num_draft_tokens_total")
    accepted = scheduler_counter(chain, "vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafted  # drafts ran, some kept and some not
