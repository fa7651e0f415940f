"""The generated references (tools/docs_reference.py) hold what the code says
today: a setting or a chart value added without `make docs-reference` fails
here, and so does one the generator would leave out."""
from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.config import env_name
from tools import docs_reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = (docs_reference.SETTINGS_PAGE, docs_reference.HELM_PAGE)
# Set by a process in the environment of the child it starts, never by an operator.
HANDED_DOWN = {"STORMSERVE_SUPERVISOR_PID", "STORMSERVE_TP_AUTHKEY"}


def rows(page: Path) -> dict[str, list[str]]:
    """A page's table rows (their cells) by the code in their first cell."""
    found = re.finditer(r"^\| `([^`]+)` \| (.*) \|$", page.read_text(), re.MULTILINE)
    return {m[1]: re.split(r"(?<!\\) \| ", m[2]) for m in found}


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_committed_page_is_what_the_code_makes(page):
    made, committed = docs_reference.pages()[page], page.read_text()
    diff = difflib.unified_diff(committed.splitlines(keepends=True), made.splitlines(keepends=True))
    assert committed == made, "run `make docs-reference`:\n" + "".join(diff)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_row_has_its_five_cells(page):
    """A pipe in a help text or a pattern would split a cell (GitHub's rule: even inside backticks)."""
    table_rows = [line for line in page.read_text().splitlines() if line.startswith("|")]
    assert table_rows
    for line in table_rows:
        assert len(re.findall(r"(?<!\\)\|", line)) == 6, line


def config_classes() -> Iterator[tuple[str, type]]:
    """(service, config class) of every services/<name>/config.py, found apart from the generator's list."""
    for path in sorted((ROOT / "services").glob("*/config.py")):
        module = importlib.import_module(f"services.{path.parent.name}.config")
        for value in vars(module).values():
            if dataclasses.is_dataclass(value) and value.__module__ == module.__name__:
                yield path.parent.name, value


def test_every_setting_of_every_config_has_a_row():
    documented = rows(docs_reference.SETTINGS_PAGE)
    found = list(config_classes())
    assert sorted(service for service, _ in found) == sorted(docs_reference.CONFIGS)
    for service, config in found:
        for field in dataclasses.fields(config):
            alias, _default, readers, _meaning = documented[env_name(field.name)]
            assert service in readers.split(", "), field.name
            assert not field.metadata["alias"] or f"`{field.metadata['alias']}`" in alias, field.name
    # Hidden from repr (keys never reach a log line), listed all the same.
    assert documented["STORMSERVE_API_KEYS"][2] == "http_edge, tokenizer"
    assert "80 % of the free device memory" in documented["STORMSERVE_KV_CACHE_MIB"][3]  # argparse's %% undone


def test_every_variable_the_source_reads_has_a_row():
    """Variables read outside the configs (os.environ) are found as string literals in the source."""
    literals = set()
    for path in (ROOT / "services").rglob("*.py"):
        literals |= set(re.findall(r"[\"'](STORMSERVE_[A-Z0-9_]+)[\"']", path.read_text()))
    assert {"STORMSERVE_CACHE_DIR", "STORMSERVE_LOG_LEVEL", "STORMSERVE_KUBE_API_URL", "STORMSERVE_WORKERS"} <= literals
    assert literals - HANDED_DOWN <= rows(docs_reference.SETTINGS_PAGE).keys()
    assert docs_reference.OUTSIDE_CONFIGS.keys() <= literals, "a variable the source no longer reads"


def schema_leaves(schema: dict, path: str, node: dict) -> Iterator[str]:
    """The path of every value below `node` that holds no properties of its own."""
    if "$ref" in node:
        node = {**schema["$defs"][node["$ref"].rsplit("/", 1)[1]], **node}
    items = node.get("items", {})
    children = [(f"{path}.{name}", child) for name, child in node.get("properties", {}).items()]
    for shape in (items, *items.get("oneOf", ())):
        children += [(f"{path}[].{name}", child) for name, child in shape.get("properties", {}).items()]
    if "properties" not in node:
        yield path
    for child_path, child in children:
        yield from schema_leaves(schema, child_path, child)


def test_every_value_of_the_chart_has_a_described_row():
    schema = json.loads((docs_reference.CHART / "values.schema.json").read_text())
    leaves = [leaf for key, node in schema["properties"].items() for leaf in schema_leaves(schema, key, node)]
    documented = rows(docs_reference.HELM_PAGE)
    for leaf in leaves:
        assert documented[leaf][-1], f"{leaf}: no description"
    assert {"worker.acceleratorResource.name", "edge.resources.requests", "apiKeys.keys[].tokensPerMinute",
            "tls.internal.certManager.issuerRef.kind", "global"} <= set(leaves)
    assert documented["worker.acceleratorResource.count"][2] == "`1`"  # the default, from values.yaml


def test_cells_escape_what_markdown_would_take():
    assert docs_reference.prose("a | b <think> `x|y` *") == r"a \| b &lt;think&gt; `x|y` \*"
    assert "|" not in docs_reference.code("^$|^[^/]") and docs_reference.code("a.b") == "`a.b`"


def test_check_writes_nothing_and_fails_until_the_pages_are_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(docs_reference, "ROOT", tmp_path)
    monkeypatch.setattr(docs_reference, "SETTINGS_PAGE", tmp_path / "settings.md")
    monkeypatch.setattr(docs_reference, "HELM_PAGE", tmp_path / "helm-values.md")
    with pytest.raises(SystemExit, match="settings.md, helm-values.md differ from the code"):
        docs_reference.main(["--check"])
    assert "+| `STORMSERVE_MAX_SEQ_LEN` |" in capsys.readouterr().out
    assert not list(tmp_path.iterdir())
    docs_reference.main([])
    docs_reference.main(["--check"])
