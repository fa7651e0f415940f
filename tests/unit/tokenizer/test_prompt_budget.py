"""Chat-template renders under a budget, in render processes that can be
stopped: request templates refused unless trusted, reserved kwargs refused,
a runaway render (the model's own template included) stopped at its time
budget without delaying other renders, huge outputs refused before
tokenizing, a cancelled request's render killed, a killed process replaced
before the next job asks for it."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from transformers import AutoTokenizer

from services.common.errors import ServiceError
from services.common.model_files import default_model_path, resolve_model
from services.common.template_kwargs import RESERVED_TEMPLATE_KWARGS
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.prompt import PromptBuilder
from stormserve.chat.v1 import chat_pb2

RUNAWAY = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
MESSAGES = [chat_pb2.ChatMessage(role="user", content="hi")]
# A model template whose work grows with the square of a message's length: instant for
# "hi", 10^10 loop turns for a 100,000-character message (the edge allows 4 Mi characters).
QUADRATIC = ("{% for m in messages %}{% for a in m['content'] %}{% for b in m['content'] %}{% endfor %}"
             "{% endfor %}{{ m['content'] }}{% endfor %}")
HUGE_MESSAGE = [chat_pb2.ChatMessage(role="user", content="x" * 100_000)]
HANG_S = 120  # only keeps a render without a budget, or a lane that never starts one, from hanging a test


def load_tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(default_model_path()))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def trusting(tokenizer):
    builder = PromptBuilder(TokenizerConfig(trust_request_chat_template=True, template_timeout_s=1.5,
                                            template_memory_mib=256), tokenizer, max_input_tokens=2048)
    builder.warm_up()
    yield builder
    builder.close()


@pytest.fixture(scope="module")
def default(tokenizer):
    builder = PromptBuilder(TokenizerConfig(), tokenizer, max_input_tokens=2048)
    yield builder
    builder.close()


@pytest.fixture(scope="module")
def quadratic():
    """A server whose model template is QUADRATIC, with one render process."""
    tokenizer = load_tokenizer()
    tokenizer.chat_template = QUADRATIC
    builder = PromptBuilder(TokenizerConfig(template_timeout_s=1.5, render_processes=1), tokenizer,
                            max_input_tokens=2048)
    builder.warm_up()
    yield builder
    builder.close()


def render(builder: PromptBuilder, messages: list[chat_pb2.ChatMessage] = MESSAGES, /, **kwargs):
    return asyncio.run(asyncio.wait_for(builder.render(messages, [], kwargs), HANG_S))


def refusal(builder: PromptBuilder, messages: list[chat_pb2.ChatMessage] = MESSAGES, /, **kwargs) -> ServiceError:
    with pytest.raises(ServiceError) as caught:
        render(builder, messages, **kwargs)
    return caught.value


def live_processes(lane) -> list:
    return [p for p in lane._processes if p.is_alive]


def eventually_one_live_process(lane):
    deadline = time.monotonic() + HANG_S
    while len(live := live_processes(lane)) != 1:
        assert time.monotonic() < deadline, "no process was started"
        time.sleep(0.05)
    return live[0]


def test_the_model_template_renders_and_tokenizes(default, tokenizer):
    prompt = render(default)
    assert prompt.text == tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                        add_generation_prompt=True)
    assert prompt.token_ids == tokenizer.encode(prompt.text, add_special_tokens=False)


def test_a_request_template_is_refused_unless_the_operator_trusts_them(default, trusting):
    error = refusal(default, chat_template="{{ 'x' }}")
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "chat_template" in error.message
    assert render(trusting, chat_template="[{{ messages[0].content }}]").text == "[hi]"
    assert refusal(trusting, chat_template=3).code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("key", sorted(RESERVED_TEMPLATE_KWARGS))
def test_reserved_kwargs_are_refused_by_name(trusting, key):
    error = refusal(trusting, **{key: True})
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and f"chat_template_kwargs.{key} " in error.message


def test_output_past_what_the_input_limit_can_hold_is_refused_before_tokenizing(trusting):
    error = refusal(trusting, chat_template="{{ 'hello ' * 2000000 }}")
    assert error.code == grpc.StatusCode.OUT_OF_RANGE and "12000000 characters" in error.message


def test_a_template_that_eats_memory_is_refused(trusting):
    error = refusal(trusting, chat_template="{{ ('a' * 100000000) * 30 }}")
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "memory" in error.message


def test_the_model_template_renders_under_the_same_time_budget(quadratic):
    assert render(quadratic).text == "hi"
    error = refusal(quadratic, HUGE_MESSAGE)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "did not finish within 1.5 s" in error.message
    assert render(quadratic).text == "hi"


def test_a_killed_render_process_is_replaced_before_the_next_job(quadratic):
    lane = quadratic.model_lane
    before = eventually_one_live_process(lane)
    refusal(quadratic, HUGE_MESSAGE)
    assert not before.is_alive
    # With no job in sight, its replacement starts; the next job runs on it.
    replacement = eventually_one_live_process(lane)
    assert replacement is not before
    assert render(quadratic).text == "hi"
    assert live_processes(lane) == [replacement]


def test_a_runaway_render_is_stopped_and_the_lane_serves_again(trusting):
    error = refusal(trusting, chat_template=RUNAWAY)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "did not finish within 1.5 s" in error.message
    assert render(trusting, chat_template="ok").text == "ok"


def test_runaway_request_templates_do_not_delay_the_model_template(trusting):
    async def scenario() -> list[str]:
        finished: list[str] = []

        async def runaway(i: int) -> None:
            with pytest.raises(ServiceError):
                await trusting.render(MESSAGES, [], {"chat_template": RUNAWAY})
            finished.append(f"runaway{i}")

        async def normal() -> None:
            await asyncio.sleep(0.2)  # the runaways hold the request lane by now
            await trusting.render(MESSAGES, [], {})
            finished.append("normal")

        await asyncio.gather(*(runaway(i) for i in range(3)), normal())
        return finished

    assert asyncio.run(scenario())[0] == "normal"


def test_cancelling_a_request_kills_its_render(trusting):
    lane = trusting.request_lane
    render(trusting, chat_template="started")  # the lane's one process is up before the runaway takes it

    async def scenario():
        task = asyncio.create_task(trusting.render(MESSAGES, [], {"chat_template": RUNAWAY}))
        await asyncio.sleep(0.5)
        (process,) = live_processes(lane)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return process

    process = asyncio.run(scenario())
    # Killed at once, long before the 1.5 s budget would have stopped it.
    assert not process.is_alive
    assert render(trusting, chat_template="again").text == "again"
