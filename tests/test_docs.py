"""The documentation: the site builds strictly (a broken link or anchor fails),
the README stays a short front page whose links and picture exist, and no page
points outside the repository."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
LINK = re.compile(r"\]\(([^)\s{}\[\]|]+)\)")  # [text](target), not a pattern such as [a-z]([0-9]{2})


def test_the_site_builds_strictly(tmp_path) -> None:
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                            cwd=ROOT, capture_output=True, text=True, env={"NO_MKDOCS_2_WARNING": "1",
                                                                            "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
    pages = list(tmp_path.rglob("index.html"))
    assert len(pages) >= 25
    home = (tmp_path / "index.html").read_text()
    assert "request-path.svg" in home and (tmp_path / "assets" / "request-path.svg").exists()


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert pages == set(re.findall(r": ([\w/.-]+\.md)$", nav, re.MULTILINE))


def test_the_readme_is_a_short_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150
    rows = [line for line in lines if line.startswith("|")]
    assert rows and max(map(len, rows)) <= 220, max(rows, key=len)
    text = "\n".join(lines)
    for needed in ("make run", "make test", "curl ", "from openai import OpenAI", "grpcurl "):
        assert needed in text
    hardware = [r for r in rows if not r.startswith("|---")]
    assert len(hardware) == 6  # the header and five kinds of hardware


def test_links_in_the_readme_and_docs_stay_inside_the_repository() -> None:
    for page in [README, *(ROOT / "docs").rglob("*.md")]:
        for target in LINK.findall(page.read_text()):
            assert "://" not in target, (page, target)
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.is_relative_to(ROOT), (page, target)
            assert path.exists(), (page, target)
