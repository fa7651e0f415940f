"""bench.draft_replay: the Speculator driven over recorded answers as for one running sequence."""
from bench.draft_replay import oracle, replay
from services.scheduler.speculation import SpeculationConfig

PROMPT = list(range(100, 160))


def test_an_answer_that_copies_its_prompt_takes_fewer_steps_than_tokens():
    answers = [{"prompt": PROMPT, "output": PROMPT[:40]}]
    figures = replay(answers, SpeculationConfig("suffix", max_draft_tokens=8), budget=23)
    assert figures["accepted"] > 0.8
    assert figures["steps"] < 39 / 3  # 39 tokens after the prefill's


def test_an_answer_with_nothing_to_copy_takes_a_step_per_token():
    answers = [{"prompt": PROMPT, "output": list(range(200, 240))}]
    figures = replay(answers, SpeculationConfig("prompt_lookup", max_draft_tokens=8), budget=23)
    assert figures == {"steps": 39, "tokens_per_step": 1.0, "accepted": 0.0}


def test_longer_drafts_take_fewer_steps_on_a_copy():
    answers = [{"prompt": PROMPT, "output": PROMPT[:40]}]
    short = replay(answers, SpeculationConfig("prompt_lookup", max_draft_tokens=2), budget=23)
    long = replay(answers, SpeculationConfig("prompt_lookup", max_draft_tokens=8), budget=23)
    assert long["steps"] < short["steps"]


def test_the_oracle_drafts_the_longest_run_seen_before():
    answers = [{"prompt": [1, 2, 3, 4, 5], "output": [9, 1, 2, 3, 7, 9, 1]}]
    # after 9: [1, 2, 3] copied and 7 sampled; then [9, 1], seen before, ends the answer
    assert oracle(answers, max_len=8) == {"steps": 2, "tokens_per_step": 3.0}
    assert oracle(answers, max_len=1)["steps"] == 3  # 9 | 1 2 | 3 7 | 9 1
