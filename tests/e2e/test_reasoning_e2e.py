"""A thinking budget through the real chain: the bundled model never writes
</think>, so with `<think>` parsing forced on (REASONING_PARSER=qwen3) all of
its output is reasoning — until a budget is spent and the scheduler appends
the early-stopping text, after which the model answers as content."""
from __future__ import annotations

import pytest

from services.tokenizer.config import TokenizerConfig
from tests.e2e.conftest import MODEL, running_chain

QUESTION = [{"role": "user", "content": "Which city is the capital of France?"}]


@pytest.fixture(scope="module")
def reasoning_chain(tmp_path_factory):
    env = {"STORMSERVE_REASONING_PARSER": "qwen3", "STORMSERVE_DTYPE": "float32"}
    with running_chain(tmp_path_factory.mktemp("reasoning"), env=env) as (chain, _):
        yield chain


def ask(chain, **extra):
    from openai import OpenAI

    client = OpenAI(base_url=chain.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    return client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=40,
                                          extra_body=extra or None)


def test_a_spent_thinking_budget_closes_the_block_and_the_answer_follows(reasoning_chain):
    free = ask(reasoning_chain).choices[0].message
    assert free.content in ("", None) and free.reasoning_content  # never closed: all reasoning

    reply = ask(reasoning_chain, chat_template_kwargs={"thinking_budget": 4})
    message = reply.choices[0].message
    early = TokenizerConfig().early_stopping_text
    before_end = early[: early.index("</think>")]
    # The first 4 tokens of the free run, then the appended text, then an answer.
    assert message.reasoning_content.endswith(before_end.rstrip("\n")) or \
        message.reasoning_content.endswith(before_end)
    assert free.reasoning_content.startswith(message.reasoning_content[: -len(before_end)].rstrip())
    assert message.content and message.content.strip()
    details = reply.usage.completion_tokens_details
    assert details.reasoning_tokens >= 4 and reply.usage.completion_tokens > details.reasoning_tokens
