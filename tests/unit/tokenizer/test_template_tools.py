"""Tools, prior tool calls and tool results reach the model's own template,
whichever way the template writes a call's arguments."""
from __future__ import annotations

import pytest

from services.tokenizer.render_worker import render_job
from services.tokenizer.template import render_jobs
from stormserve.chat.v1 import chat_pb2
from tests.unit.tokenizer.tool_fixtures import smol_tokenizer

TOJSON = ("{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}"
          "{% for c in m.tool_calls or [] %}<call>{{ c.function.arguments | tojson }}</call>{% endfor %}"
          "{% if m.role == 'tool' %}<result id={{ m.tool_call_id }}>{{ m.content }}</result>{% endif %}{% endfor %}")
CONCAT = ("{% for m in messages %}{% for c in m.tool_calls or [] %}"
          "{{ '<call>' + c['function']['arguments'] + '</call>' }}{% endfor %}{% endfor %}")
ARGS = '{"order_id": "12345"}'


@pytest.fixture(scope="module")
def tokenizer():
    return smol_tokenizer()


def render(tokenizer, messages, tools, kwargs, add_generation_prompt) -> str:
    """What the tokenizer's render processes answer: the first job, then the
    next one if the template raised a TypeError on it."""
    for job in render_jobs(tokenizer, messages, tools, kwargs, add_generation_prompt, max_chars=10**6):
        answer = render_job(job)
        if answer.get("error_type") != "TypeError":
            break
    return answer["text"]


def conversation(arguments: str = ARGS) -> list[chat_pb2.ChatMessage]:
    call = chat_pb2.ToolCall(id="tool_call_8p2Nk", type="function",
                             function=chat_pb2.FunctionCall(name="get_delivery_date", arguments=arguments))
    return [chat_pb2.ChatMessage(role="user", content="When?"),
            chat_pb2.ChatMessage(role="assistant", tool_calls=[call]),
            chat_pb2.ChatMessage(role="tool", content="2024.09.10", tool_call_id="tool_call_8p2Nk")]


@pytest.mark.parametrize("template", [TOJSON, CONCAT])
def test_prior_call_renders_as_sent_in_either_template_style(tokenizer, template):
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    try:
        tool = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name="get_delivery_date"))
        text = render(tokenizer, conversation(), [tool], {}, add_generation_prompt=False)
        assert f"<call>{ARGS}</call>" in text
        if template is TOJSON:
            assert text.startswith("[get_delivery_date]")
            assert "<result id=tool_call_8p2Nk>2024.09.10</result>" in text
        else:  # arguments that are not a JSON object reach the template as the text sent
            assert "<call>not json</call>" in render(tokenizer, conversation("not json"), [], {}, False)
    finally:
        tokenizer.chat_template = original
