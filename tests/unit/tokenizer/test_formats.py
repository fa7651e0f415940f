"""Which tool format and whether reasoning: per model (config or detection)
and per request (tools, enable_thinking, the rendered prompt)."""
from __future__ import annotations

import pytest

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.formats import ModelFormats, output_options
from tests.unit.tokenizer.tool_fixtures import deepseek_like_tokenizer, smol_tokenizer

QWEN3_LIKE = "{{ '<tool_call>' }}{% if enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
R1_LIKE = "{{ '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + '```json' }}<think>\n"


@pytest.fixture(scope="module")
def smol():
    return smol_tokenizer()


def formats_for(tokenizer, template: str | None, model_type: str = "llama", **config) -> ModelFormats:
    original = tokenizer.chat_template
    tokenizer.chat_template = template if template is not None else original
    try:
        return ModelFormats.detect(TokenizerConfig(**config), tokenizer, model_type)
    finally:
        tokenizer.chat_template = original


def test_bundled_model_defaults_to_hermes_without_reasoning(smol):
    formats = formats_for(smol, None)
    assert (formats.tool_parser, formats.reasoning, formats.marker_ids) == ("hermes", False, {})


@pytest.mark.parametrize("template, model_type, tool_parser, reasoning", [
    (QWEN3_LIKE, "qwen3", "hermes", True),
    (R1_LIKE, "deepseek_v3", "deepseek_v3", True),
    ("{{ '<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + arguments }}", "deepseek_v3", "deepseek_v31",
     False),
    ("plain", "chatglm", "chatglm3", False),
])
def test_detection_from_model_type_and_template(smol, template, model_type, tool_parser, reasoning):
    formats = formats_for(smol, template, model_type)
    assert (formats.tool_parser, formats.reasoning) == (tool_parser, reasoning)


def test_config_overrides_detection(smol):
    formats = formats_for(smol, QWEN3_LIKE, "qwen3", tool_call_parser="deepseek_v3", reasoning_parser="none")
    assert (formats.tool_parser, formats.reasoning) == ("deepseek_v3", False)
    assert formats_for(smol, None, reasoning_parser="deepseek_r1").reasoning
    with pytest.raises(ValueError, match="tool_call_parser"):
        TokenizerConfig(tool_call_parser="llama3_json")


def test_special_markers_are_found():
    tokenizer = deepseek_like_tokenizer()
    formats = formats_for(tokenizer, None)
    assert formats.special_marker_ids == frozenset(formats.marker_ids.values())
    assert tokenizer.convert_tokens_to_ids("<｜tool▁sep｜>") in formats.special_marker_ids


def test_output_options_per_request(smol):
    reasoning = formats_for(smol, QWEN3_LIKE, "qwen3")
    assert output_options(reasoning, False, {}, "<|im_start|>assistant\n").tool_parser is None
    assert output_options(reasoning, True, {}, "<|im_start|>assistant\n").tool_parser == "hermes"
    assert output_options(reasoning, False, {}, "<|im_start|>assistant\n").reasoning
    assert output_options(reasoning, False, {}, "<｜Assistant｜><think>\n").reasoning  # R1 opens it
    assert not output_options(reasoning, False, {"enable_thinking": False}, "<|im_start|>assistant\n").reasoning
    # Qwen3's template closes the block in the prompt when thinking is off.
    assert not output_options(reasoning, False, {}, "assistant\n<think>\n\n</think>\n\n").reasoning
    assert not output_options(formats_for(smol, None), True, {}, "<think>\n").reasoning


def test_special_markers_are_kept_only_while_parsing():
    tokenizer = deepseek_like_tokenizer()
    formats = formats_for(tokenizer, None)
    assert output_options(formats, True, {}, "").keep_special_ids == formats.special_marker_ids
    assert output_options(formats, False, {}, "").keep_special_ids == frozenset()
