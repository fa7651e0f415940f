"""An input-grounded workload, seeded and synthetic (no downloads): each prompt
holds a document, a piece of code, a log or a table of records, and asks the
model to repeat, edit or extract from it — answers that copy their input, as in
RAG answers, code edits and JSON re-shaping. Speculative decoding without a
draft model pays on these; bench.serve's random prompts are the other end.
"""
from __future__ import annotations

import random

NAMES = "Ada Bruno Chen Dara Elif Femi Goran Hana Ivo Juno Kofi Lena Mika Nour Oren Pia".split()
CITIES = "Lisbon Osaka Lagos Quito Tartu Perth Cusco Hanoi Fez Bergen Davos Split".split()
NOUNS = ("bridge report budget river sensor engine harbor library garden market station "
         "tunnel archive orchard pipeline reactor").split()
VERBS = "inspected repaired measured replaced approved reviewed moved painted tested logged".split()
LEVELS = ("INFO", "INFO", "INFO", "WARN", "ERROR")


def _document(rng: random.Random, num_words: int) -> str:
    sentences = []
    while sum(len(s.split()) for s in sentences) < num_words:
        sentences.append(f"On day {rng.randint(1, 28)} {rng.choice(NAMES)} {rng.choice(VERBS)} the "
                         f"{rng.choice(NOUNS)} in {rng.choice(CITIES)} for {rng.randint(2, 900)} euros.")
    return " ".join(sentences)


def _code(rng: random.Random, num_words: int) -> tuple[str, str, str]:
    old, new = rng.sample(["total", "count", "value", "score", "price", "weight"], 2)
    lines = [f"def update_{rng.choice(NOUNS)}(items):", f"    {old} = 0"]
    while len(" ".join(lines).split()) < num_words:
        noun = rng.choice(NOUNS)
        lines += [f"    for {noun} in items:", f"        if {noun}.level > {rng.randint(1, 9)}:",
                  f"            {old} += {noun}.size * {rng.randint(2, 7)}"]
    lines.append(f"    return {old}")
    return "\n".join(lines), old, new


def _log(rng: random.Random, num_words: int) -> str:
    lines = []
    while len(" ".join(lines).split()) < num_words:
        lines.append(f"12:{rng.randint(10, 59)}:{rng.randint(10, 59)} {rng.choice(LEVELS)} "
                     f"{rng.choice(NOUNS)}-{rng.randint(1, 40)} {rng.choice(VERBS)} by {rng.choice(NAMES)}")
    return "\n".join(lines)


def _records(rng: random.Random, num_words: int) -> str:
    lines = []
    while len(" ".join(lines).split()) < num_words:
        lines.append(f"name: {rng.choice(NAMES)}, city: {rng.choice(CITIES)}, age: {rng.randint(18, 90)}")
    return "\n".join(lines)


# Tokens per word of each kind with the bundled model's tokenizer (numbers,
# times and code punctuation split into several tokens), so that a prompt has
# about the tokens asked for.
TOKENS_PER_WORD = {"repeat": 1.7, "edit": 2.15, "extract": 3.3, "json": 2.75}


def grounded_prompt(rng: random.Random, input_len: int) -> str:
    """One prompt of about `input_len` tokens."""
    kind = rng.choice(["repeat", "edit", "extract", "json"])
    words = max(10, int(input_len / TOKENS_PER_WORD[kind]))
    if kind == "repeat":
        return f"Repeat the following report exactly, word for word.\n\n{_document(rng, words)}"
    if kind == "edit":
        code, old, new = _code(rng, words)
        return f"Rename the variable `{old}` to `{new}` in this code and output the whole code.\n\n{code}"
    if kind == "extract":
        return f"Copy every line of this log, in order, exactly as written.\n\n{_log(rng, words)}"
    return f"Convert these records to a JSON list of objects with keys name, city and age.\n\n{_records(rng, words)}"


def make_grounded_prompts(n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [grounded_prompt(rng, input_len) for _ in range(n)]
