"""A chat-template render process: `python -m services.tokenizer.render_worker`.

A Jinja template is a program. The model's own template is trusted, but the
messages it loops over are not, and a request-supplied template (when the
operator allows them) can loop for minutes or build gigabytes. Python cannot
stop such code in a thread, so renders run here, one at a time, and the
tokenizer kills the process when a render runs past its time budget or its
request is cancelled (render_pool.py). The address space is capped, so a
render that builds a huge string fails with MemoryError instead of taking the
machine's memory, and renders of client-supplied templates run at a low CPU
priority, so that one spinning until its time runs out takes CPU only from idle.

Protocol on stdin/stdout: each message is an 8-byte big-endian length and that
many bytes of JSON. A job is `{"template", "messages", "tools",
"template_vars", "add_generation_prompt", "continue_final_message",
"max_chars"}`; the answer is `{"text"}`, `{"too_long": num_chars}` or
`{"error", "error_type"}`. The process says `{"ready": true}` once it has
started, and exits when stdin closes.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import sys
from typing import Any, BinaryIO

from transformers.utils.chat_template_utils import render_jinja_template

HEADER = struct.Struct(">Q")


def write_message(stream: BinaryIO, message: dict[str, Any]) -> None:
    payload = json.dumps(message, ensure_ascii=False).encode("utf-8", "surrogatepass")
    stream.write(HEADER.pack(len(payload)) + payload)
    stream.flush()


def _read_exactly(stream: BinaryIO, size: int) -> bytes | None:
    data = stream.read(size)
    return data if data is not None and len(data) == size else None


def read_message(stream: BinaryIO) -> dict[str, Any] | None:
    """The next message, or None at end of stream."""
    header = _read_exactly(stream, HEADER.size)
    if header is None:
        return None
    payload = _read_exactly(stream, HEADER.unpack(header)[0])
    return None if payload is None else json.loads(payload.decode("utf-8", "surrogatepass"))


def render_job(job: dict[str, Any]) -> dict[str, Any]:
    """Render one job as transformers' apply_chat_template(tokenize=False) does."""
    try:
        rendered, _ = render_jinja_template(
            conversations=[job["messages"]],
            tools=job["tools"],
            chat_template=job["template"],
            add_generation_prompt=job["add_generation_prompt"],
            continue_final_message=job["continue_final_message"],
            **job["template_vars"],
        )
    except MemoryError:
        return {"error": "the chat template used more memory than its budget", "error_type": "MemoryError"}
    except Exception as exc:  # noqa: BLE001 - a template's failure is its caller's input problem
        return {"error": str(exc)[:1000], "error_type": type(exc).__name__}
    text = rendered[0]
    if len(text) > job["max_chars"]:
        return {"too_long": len(text)}
    return {"text": text}


def _cap_memory(budget_mib: int) -> None:
    """Cap the address space at what the process maps now plus the budget."""
    with open("/proc/self/statm") as statm:
        mapped = int(statm.read().split()[0]) * resource.getpagesize()
    limit = mapped + budget_mib * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-mib", type=int, required=True, help="address space a render may add")
    parser.add_argument("--nice", type=int, default=0, help="added to the process's nice value")
    args = parser.parse_args()
    _cap_memory(args.memory_mib)
    os.nice(args.nice)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    write_message(stdout, {"ready": True})  # start-up is not part of any render's time budget
    while (job := read_message(stdin)) is not None:
        write_message(stdout, render_job(job))


if __name__ == "__main__":
    main()
