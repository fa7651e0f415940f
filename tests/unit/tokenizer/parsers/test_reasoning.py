import pytest

from services.tokenizer.parsers.reasoning import ReasoningParser, split_reasoning

CASES = [
    ("<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("Opened in the prompt.</think>\n\nAnswer.", "Opened in the prompt.", "\n\nAnswer."),  # R1 template
    ("<think>cut short by max_tokens", "cut short by max_tokens", ""),
    ("<think></think>Direct.", "", "Direct."),
]


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_split_non_stream(text, reasoning, content):
    assert split_reasoning(text) == (reasoning, content)


@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_stream_every_boundary(text, reasoning, content):
    for cut in range(len(text) + 1):
        parser = ReasoningParser()
        parts = [parser.feed(text[:cut]), parser.feed(text[cut:]), parser.flush()]
        assert "".join(p[0] for p in parts) == reasoning, cut
        assert "".join(p[1] for p in parts) == content, cut


def test_thinking_off_classifies_nothing_as_reasoning():
    assert split_reasoning("<think>x</think>y", enabled=False) == (None, "<think>x</think>y")
    parser = ReasoningParser(enabled=False)
    assert parser.feed("a</think>b") == ("", "a</think>b")


def test_reasoning_state_is_visible_for_token_counting():
    parser = ReasoningParser()
    parser.feed("<think>hmm")
    assert parser.is_reasoning
    parser.feed("</think>ok")
    assert not parser.is_reasoning
