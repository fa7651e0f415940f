"""The reference pages made from the code, so that they cannot drift from it:
docs/operating/settings.md from every service's config (services/<name>/config.py)
and the variables read outside them, docs/operating/helm-values.md from the
chart's values.schema.json (types, limits, descriptions) and values.yaml (defaults).

    python -m tools.docs_reference           # write the pages (`make docs-reference`)
    python -m tools.docs_reference --check   # exit 1, with a diff, where a page differs
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import html
import json
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.common.config import env_name
from services.envoy.config import EnvoyConfig
from services.http_edge.config import EdgeConfig
from services.scheduler.config import SchedulerConfig
from services.tokenizer.config import TokenizerConfig
from services.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "k8s"
SETTINGS_PAGE = ROOT / "docs" / "operating" / "settings.md"
HELM_PAGE = ROOT / "docs" / "operating" / "helm-values.md"
GENERATED = ("Generated from {source} by `make docs-reference` (`python -m tools.docs_reference`): "
             "do not edit this page by hand; change the source and run it again.")

# Each service's config by the module that reads it, in the order a request meets them.
CONFIGS: dict[str, type] = {"http_edge": EdgeConfig, "tokenizer": TokenizerConfig, "scheduler": SchedulerConfig,
                            "worker": WorkerConfig, "envoy": EnvoyConfig}
MAKE_RUN = "make run"  # services/common/supervisor.py
EVERY_PROCESS = (*CONFIGS, MAKE_RUN)

# Variables read from os.environ outside the configs, so with no help text in the
# code to take: (readers, default, meaning). tests/unit/test_docs_reference.py
# fails when the source reads one that is not here.
OUTSIDE_CONFIGS: dict[str, tuple[tuple[str, ...], str, str]] = {
    "STORMSERVE_LOG_LEVEL": (EVERY_PROCESS, "INFO", "least severe records logged: DEBUG, INFO, WARNING, ERROR or "
                                                    "CRITICAL"),
    "STORMSERVE_LOG_FORMAT": (EVERY_PROCESS, "text", "text: one line per record; json: one JSON object per line "
                                                     "(ts, level, service, logger, msg and the record's fields)"),
    "STORMSERVE_CACHE_DIR": (("tokenizer", "worker"), "~/.cache/stormserve",
                             "writable directory for models converted from GGUF and the CPU kernels compiled for "
                             "this machine"),
    "STORMSERVE_KUBE_API_URL": (("scheduler",), "", "Kubernetes API server of worker_discovery=endpointslices "
                                                    "instead of the in-cluster one (tests, runs outside a cluster; "
                                                    "plain http allowed); empty = in-cluster"),
    "STORMSERVE_HOST": ((MAKE_RUN,), "127.0.0.1", "the edge's listen address; the other services stay on 127.0.0.1"),
    "STORMSERVE_PORT": ((MAKE_RUN,), "8000", "the edge's port; the /metrics ports of the tokenizer, the scheduler "
                                             "and the workers follow it (+1, +2, +3 on)"),
    "STORMSERVE_WORKERS": ((MAKE_RUN,), "1", "worker processes per serving group, on ports 50053 on; unless "
                                             "STORMSERVE_NUM_THREADS is set, each gets its share of the cores"),
    "STORMSERVE_GROUPS": ((MAKE_RUN,), "1", "serving groups, a scheduler and its own workers each (the first "
                                            "scheduler on 50052, the others after the workers' ports); the "
                                            "tokenizer spreads requests over them"),
    "STORMSERVE_DISAGGREGATE": ((MAKE_RUN,), "", "prefill and decode workers per serving group, e.g. 1P1D "
                                                 "(in place of STORMSERVE_WORKERS; see Prefill/decode "
                                                 "disaggregation); empty = every worker both"),
    "STORMSERVE_ENVOY": ((MAKE_RUN,), "", "1, true, yes or on: Envoy in front of the chain, configured by the envoy "
                                          "settings (listening on STORMSERVE_ENVOY_PORT); empty = none"),
}


@dataclass(frozen=True)
class Reading:
    """What one process makes of a setting: its default and meaning there (Markdown)."""

    reader: str
    default: str
    meaning: str
    alias: str = ""


# ---- Markdown ---------------------------------------------------------------


def code(text: str) -> str:
    """Inline code for a table cell. A pipe ends a cell in GitHub's Markdown even
    inside backticks, and Python-Markdown (the site) shows an escaped `\\|` there
    as it is: code with a pipe becomes <code> with every mark an HTML entity,
    which both show literally. No text at all is *empty*."""
    if not text:
        return "*empty*"
    if "|" not in text and "`" not in text:
        return f"`{text}`"
    return "<code>" + "".join(c if c.isalnum() or c == " " else f"&#{ord(c)};" for c in text) + "</code>"


def prose(text: str) -> str:
    """Text for a table cell: its `code spans` as they are; elsewhere `<think>`
    and `&` as entities, and pipes, asterisks and backslashes escaped."""
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(part if i % 2 else re.sub(r"([|*\\])", r"\\\1", html.escape(part, quote=False))
                   for i, part in enumerate(parts))


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header),
            *("| " + " | ".join(row) + " |" for row in rows)]


def by_reader(values: dict[str, str]) -> str:
    """One value when every reader has the same, else each one after its readers."""
    readers_of: dict[str, list[str]] = {}
    for reader, value in values.items():
        readers_of.setdefault(value, []).append(reader)
    if len(readers_of) == 1:
        return next(iter(readers_of))
    return "<br>".join(f"**{', '.join(readers)}**: {value}" for value, readers in readers_of.items())


# ---- settings ---------------------------------------------------------------


def setting_default(value: Any) -> str:
    """A default as one would write it in the environment."""
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, tuple):
        return code(",".join(map(str, value)))
    # Paths inside the checkout (Envoy's descriptor set) vary with where it lies.
    text = str(value).replace(str(ROOT), "<checkout>")
    return code(json.dumps(text, ensure_ascii=False)[1:-1])  # a newline as \n


def settings() -> dict[str, list[Reading]]:
    """Every setting by its environment name, with what each process that reads it makes of it."""
    by_name: dict[str, list[Reading]] = {}
    for reader, config in CONFIGS.items():
        for field in dataclasses.fields(config):
            meaning = field.metadata["help"].replace("%%", "%")  # argparse's escape of %
            by_name.setdefault(env_name(field.name), []).append(
                Reading(reader, setting_default(field.default), prose(meaning), field.metadata["alias"] or ""))
    for name, (readers, default, meaning) in OUTSIDE_CONFIGS.items():
        for reader in readers:
            by_name.setdefault(name, []).append(Reading(reader, code(default), prose(meaning)))
    return by_name


def setting_row(name: str, readings: list[Reading]) -> tuple[str, ...]:
    aliases = dict.fromkeys(code(r.alias) for r in readings if r.alias)
    return (code(name), ", ".join(aliases), by_reader({r.reader: r.default for r in readings}),
            ", ".join(r.reader for r in readings), by_reader({r.reader: r.meaning for r in readings}))


def settings_page() -> str:
    by_name = settings()
    sections = {"Shared settings": [n for n, r in by_name.items() if len(r) > 1]}
    for process in EVERY_PROCESS:
        sections[process] = [n for n, r in by_name.items() if [x.reader for x in r] == [process]]
    lines = [
        "# Settings reference", "",
        GENERATED.format(source="the help texts in `services/<name>/config.py`"), "",
        "Every setting is an environment variable. The settings of a service's config are also flags of "
        "`python -m services.<name>`: `STORMSERVE_MAX_SEQ_LEN` is `--max-seq-len`, and `--maxSeqLen` by its "
        "MindIE name. A flag wins over the environment, the environment over the default. Booleans are "
        "`1`, `true`, `yes`, `on` or `0`, `false`, `no`, `off`; lists are comma-separated.",
    ]
    intros = {"Shared settings": "Read by several processes under one name, so one environment (or one "
                                 "ConfigMap) keeps them consistent.",
              MAKE_RUN: "Read by the supervisor that `make run` starts (`python -m services.common.supervisor`)."}
    for title, names in sections.items():
        lines += ["", f"## {title}", "", intros.get(title, f"Read by `python -m services.{title}` alone."), ""]
        lines += table(("Environment", "MindIE name", "Default", "Read by", "Meaning"),
                       [setting_row(name, by_name[name]) for name in names])
    return "\n".join(lines) + "\n"


# ---- Helm values ------------------------------------------------------------


def resolved(schema: dict, node: dict) -> dict:
    """`node` with its `$ref` (#/$defs/...) filled in; the node's own keys (a description) win."""
    if "$ref" not in node:
        return node
    target = schema
    for part in node["$ref"].removeprefix("#/").split("/"):
        target = target[part]
    return {**resolved(schema, target), **{k: v for k, v in node.items() if k != "$ref"}}


def walk(schema: dict, path: str, node: dict) -> Iterator[tuple[str, dict]]:
    """(path, node) of `node` and of every property below it; `keys[].name` is a property of an array's items."""
    node = resolved(schema, node)
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(schema, f"{path}.{name}", child)
    items = resolved(schema, node.get("items", {}))
    for shape in (items, *items.get("oneOf", ())):
        for name, child in shape.get("properties", {}).items():
            yield from walk(schema, f"{path}[].{name}", child)


def type_name(schema: dict, node: dict) -> str:
    if "oneOf" in node:
        return " or ".join(type_name(schema, resolved(schema, shape)) for shape in node["oneOf"])
    kinds = node.get("type", "any")
    names = []
    for kind in [kinds] if isinstance(kinds, str) else kinds:
        if kind == "array" and "items" in node:
            kind = "array of " + type_name(schema, resolved(schema, node["items"]))
        elif kind == "object" and isinstance(node.get("additionalProperties"), dict):
            kind = "map of " + type_name(schema, resolved(schema, node["additionalProperties"]))
        names.append(kind)
    return " or ".join(names)


def yaml_text(value: Any) -> str:
    """A value as values.yaml would write it, on one line."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=1 << 20)
    return text.removesuffix("\n...\n").strip()  # a scalar ends its document with "..."


def allowed(node: dict) -> str:
    rules = []
    if "enum" in node:
        rules.append(", ".join(code(yaml_text(v)) for v in node["enum"]))
    low, high = node.get("minimum"), node.get("maximum")
    if low is not None or high is not None:
        rules.append(f"[{low}, {high}]" if low is not None and high is not None
                     else f"≥ {low}" if low is not None else f"≤ {high}")
    if "minLength" in node:
        rules.append("not empty" if node["minLength"] == 1 else f"at least {node['minLength']} characters")
    if "maxLength" in node:
        rules.append(f"at most {node['maxLength']} characters")
    if "pattern" in node:
        rules.append("matches " + code(node["pattern"]))
    if "pattern" in node.get("propertyNames", {}):
        rules.append("names match " + code(node["propertyNames"]["pattern"]))
    return "; ".join(rules)


def default(values: Any, path: str) -> str:
    """The value at `path` in values.yaml; empty where it has none (an array's items, `global`)."""
    for key in path.split("."):
        if not isinstance(values, dict) or key not in values:
            return ""
        values = values[key]
    return code(yaml_text(values))


def value_row(schema: dict, values: dict, path: str, node: dict) -> tuple[str, ...]:
    if "description" not in node:
        raise SystemExit(f"{path} has no description in deploy/k8s/values.schema.json")
    value = "" if "properties" in node else default(values, path)  # an object's values have their own rows
    return code(path), type_name(schema, node), allowed(node), value, prose(node["description"])


def helm_page() -> str:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    lines = [
        "# Helm values reference", "",
        GENERATED.format(source="`deploy/k8s/values.schema.json` and `deploy/k8s/values.yaml`"), "",
        "Every value of the chart in `deploy/k8s`: its type, what the schema allows (Helm refuses anything else "
        "at install, naming the value) and its default. `config` and each component's `env` take the "
        "[settings](settings.md) by their names without `STORMSERVE_`.",
    ]
    for key, node in schema["properties"].items():
        rows = list(walk(schema, key, node))
        lines += ["", f"## {key}", ""]
        if "properties" in rows[0][1]:  # an object: its description, then a row for each value in it
            description = prose(rows[0][1]["description"])
            lines += [description[:1].upper() + description[1:] + ".", ""]
            rows = rows[1:]
        lines += table(("Value", "Type", "Allowed", "Default", "Description"),
                       [value_row(schema, values, path, n) for path, n in rows])
    return "\n".join(lines) + "\n"


# ---- the command ------------------------------------------------------------


def pages() -> dict[Path, str]:
    return {SETTINGS_PAGE: settings_page(), HELM_PAGE: helm_page()}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.docs_reference", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff where a committed page differs from the code")
    args = parser.parse_args(argv)
    stale = []
    for path, page in pages().items():
        name = path.relative_to(ROOT).as_posix()
        committed = path.read_text() if path.exists() else ""
        if committed == page:
            continue
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(committed.splitlines(keepends=True),
                                                       page.splitlines(keepends=True),
                                                       f"{name} (committed)", f"{name} (from the code)"))
            stale.append(name)
        else:
            path.write_text(page)
            print(f"wrote {name}")
    if stale:
        raise SystemExit(f"{', '.join(stale)} differ from the code: run `make docs-reference`")


if __name__ == "__main__":
    main()
