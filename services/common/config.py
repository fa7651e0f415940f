"""One typed config mechanism for every service: a frozen dataclass filled from
CLI flags and environment variables (12-factor).

Each field `max_seq_len` is read from `--max-seq-len`, from its reference name
(`--maxSeqLen`, given as `alias` in the field metadata) and from the environment
variable `STORMSERVE_MAX_SEQ_LEN`; a flag wins over the environment, which wins
over the default. Settings shared by several services (e.g. `maxSeqLen`) use the
same name everywhere, so one environment serves the whole chain.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "STORMSERVE_"


def setting(default: Any, help: str, alias: str | None = None) -> Any:
    """A config field with its documentation and optional reference (MindIE) name."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for sequence defaults")
    return dataclasses.field(default=default, metadata={"help": help, "alias": alias})


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off, any case; anything else is an error."""
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _converter(tp: Any):
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _converter(args[0])
        return lambda text: None if text.strip() == "" else inner(text)
    if origin is tuple:
        (item_type, *_rest) = typing.get_args(tp)
        item = _converter(item_type)
        return lambda text: tuple(item(x.strip()) for x in text.split(",") if x.strip())
    if tp is bool:
        return parse_bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"unsupported config type {tp!r}")


def load_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from flags (argv) and the environment; the dataclass validates itself."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=cls.__name__, description=cls.__doc__)
    for f in dataclasses.fields(cls):
        flags = ["--" + f.name.replace("_", "-")]
        if f.metadata.get("alias"):
            flags.append("--" + f.metadata["alias"])
        parser.add_argument(
            *flags,
            dest=f.name,
            default=None,
            help=f"{f.metadata.get('help', '')} (env {env_name(f.name)}; default {f.default!r})",
        )
    args = parser.parse_args(argv)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = getattr(args, f.name)
        if raw is None:
            raw = environ.get(env_name(f.name))
        if raw is None:
            continue
        try:
            values[f.name] = _converter(hints[f.name])(raw)
        except ValueError as exc:
            parser.error(f"{f.name}: {exc}")
    try:
        return cls(**values)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def require(condition: bool, message: str) -> None:
    """Validation helper for config __post_init__ methods."""
    if not condition:
        raise ValueError(message)
