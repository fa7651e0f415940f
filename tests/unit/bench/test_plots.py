"""bench.plots draws every figure set of bench/figures.json as a PNG of the page's
size; docs/performance.md shows every set's picture (committed under
docs/performance/, linked relatively) with its command, date and CPU; and every
bench command shown there, in figures.json and in bench/README.md parses with
today's flags."""
from __future__ import annotations

import argparse
import importlib
import re
import shlex
import struct
import sys
from datetime import date
from pathlib import Path

import pytest

from bench import plots

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "performance.md"
IMAGES = ROOT / "docs" / "performance"
HOW_TO = ROOT / "bench" / "README.md"
FIGURE_SETS = plots.load()
IMAGE_LINK = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) of a PNG, from its IHDR chunk."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def flat(text: str) -> str:
    """Whitespace and shell line continuations folded, so a wrapped caption or command compares."""
    return re.sub(r"\s+", " ", text.replace("\\\n", " "))


def caption(page: str, image: str) -> str:
    """The page's text from an image's link to the next image or heading: its caption."""
    start = page.index(f"]({image})")
    ends = [m.start() for m in re.finditer(r"!\[|\n##", page) if m.start() > start]
    return page[start:min(ends, default=len(page))]


def test_bench_plots_draws_every_figure_set_at_the_page_size(tmp_path):
    plots.main(["--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{fs['id']}.png" for fs in FIGURE_SETS)
    for path in tmp_path.iterdir():
        assert png_size(path.read_bytes()) == plots.SIZE_PX, path.name


def test_every_figure_set_records_what_made_it():
    assert len({fs["id"] for fs in FIGURE_SETS}) == len(FIGURE_SETS)
    for fs in FIGURE_SETS:
        assert fs["kind"] in plots.DRAWERS, fs["id"]
        date.fromisoformat(fs["date"])
        assert fs["cpu"] and fs["peer"] and fs["title"], fs["id"]
        assert fs["command"] and all("-m bench." in command for command in fs["command"]), fs["id"]
        assert fs["rows"] and all(len(row) == len(fs["columns"]) for row in fs["rows"]), fs["id"]


def test_every_picture_on_the_page_is_committed_and_drawn_by_a_figure_set():
    links = IMAGE_LINK.findall(PAGE.read_text())
    ids = {fs["id"] for fs in FIGURE_SETS}
    assert links
    for link in links:
        assert re.fullmatch(r"performance/[a-z0-9-]+\.png", link), f"{link}: keep links relative"
        assert Path(link).stem in ids, f"{link} is drawn by no figure set"
        assert png_size((PAGE.parent / link).read_bytes()) == plots.SIZE_PX, link
    assert sorted(p.name for p in IMAGES.iterdir()) == sorted(Path(link).name for link in links), \
        "docs/performance/ holds exactly the pictures the page shows"


@pytest.mark.parametrize("fs", FIGURE_SETS, ids=lambda fs: fs["id"])
def test_every_figure_set_is_on_the_page_with_its_command_date_and_cpu(fs):
    page = PAGE.read_text()
    assert f"](performance/{fs['id']}.png)" in page, f"{fs['id']} is not on the page"
    text = flat(caption(page, f"performance/{fs['id']}.png"))
    assert fs["date"] in text
    assert flat(fs["cpu"]) in text
    for command in fs["command"]:
        assert flat(command) in text, command


# --- every bench command shown parses with today's flags --------------------------------------

class Parsed(Exception):
    """Raised once a tool's command line has parsed, before the tool runs."""


def shown_commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, argv) of every `-m bench.…` command on the page, in the how-to and in figures.json."""
    texts = {"docs/performance.md": PAGE.read_text(), "bench/README.md": HOW_TO.read_text(),
             "bench/figures.json": "\n".join(c for fs in FIGURE_SETS for c in fs["command"])}
    found = []
    for where, text in texts.items():
        for line in text.replace("\\\n", " ").splitlines():
            for module, rest in re.findall(r"-m (bench\.\w+)([^`\n]*)", line):
                rest = re.split(r"\s(?:&|&&|\||;)(?:\s|$)|\s#", rest.replace("<edge pid>", "1234"))[0]
                found.append((where, module, shlex.split(rest)))
    return found


def parse(module: str, argv: list[str], monkeypatch) -> list[str]:
    """Parse `argv` as the tool's main() would; the arguments it leaves to another tool (step_ab)."""
    tool = importlib.import_module(module)
    parse_args, parse_known_args = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside_parse_args = []

    def known(self, args=None, namespace=None):
        result = parse_known_args(self, args, namespace)
        if not inside_parse_args:
            raise Parsed(result[1])
        return result

    def strict(self, args=None, namespace=None):
        inside_parse_args.append(True)
        parse_args(self, args, namespace)  # exits on a flag the tool does not have
        raise Parsed([])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", known)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", strict)
    monkeypatch.setattr(sys, "argv", [module, *argv])
    with pytest.raises(Parsed) as parsed:
        tool.main()
    monkeypatch.undo()
    return parsed.value.args[0]


@pytest.mark.parametrize("where, module, argv", shown_commands(),
                         ids=lambda value: value if isinstance(value, str) else " ".join(value)[:60])
def test_every_bench_command_shown_parses_with_todays_flags(where, module, argv, monkeypatch):
    assert module in {f"bench.{p.stem}" for p in (ROOT / "bench").glob("*.py")}, f"{where}: no {module}"
    left = parse(module, argv, monkeypatch)
    if module == "bench.step_ab":  # the rest, and each tree's own flags, go to bench.step_time
        trees = [spec for flag, spec in zip(argv, argv[1:]) if flag == "--tree"]
        for own in (shlex.split(spec.split("=", 1)[1])[1:] for spec in trees):
            assert parse("bench.step_time", [*left, *own], monkeypatch) == []
    else:
        assert left == []
