"""Chat-template renders in separate processes that can be stopped.

A lane is a few render processes (render_worker.py), each driven by one thread
of the lane's executor: a job waits in the executor's queue for a free
process, then gets `timeout_s` to answer. A render past its time is killed,
and so is the render of a request that was cancelled (its client left); a
job cancelled while still queued never starts. A killed process is replaced
at once, in the background, so the next job of its thread finds it started
(or waits only for the rest of its start); one found dead by its thread's
next job (it died while idle) is started again then.

The tokenizer keeps two lanes: the model's own template, and request-supplied
templates (only when the operator allows them), so runaway client templates
can fill their own lane but never delay the renders of ordinary requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.tokenizer.render_worker import HEADER, write_message

log = logging.getLogger(__name__)
START_TIMEOUT_S = 120.0  # imports on a loaded 2-core machine; not a render's budget
ROOT = Path(__file__).resolve().parents[2]


class RenderTimeout(Exception):
    """The render ran past its time budget and was stopped."""


class RenderCrashed(Exception):
    """The render process died (or was killed) before answering."""


class _RenderProcess:
    """One render_worker process and the pipes to it."""

    def __init__(self, memory_mib: int, nice: int):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.tokenizer.render_worker", "--memory-mib", str(memory_mib),
             "--nice", str(nice)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env,
        )
        try:
            self._answer(time.monotonic() + START_TIMEOUT_S)  # {"ready": true}
        except (RenderTimeout, RenderCrashed):
            self.kill()
            raise RenderCrashed() from None

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()

    def _read(self, size: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        data = bytearray()
        while len(data) < size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RenderTimeout()
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                piece = os.read(fd, size - len(data))
                if not piece:
                    raise RenderCrashed()
                data += piece
        return bytes(data)

    def _answer(self, deadline: float) -> dict[str, Any]:
        (size,) = HEADER.unpack(self._read(HEADER.size, deadline))
        return json.loads(self._read(size, deadline).decode("utf-8", "surrogatepass"))

    def run(self, job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        try:
            write_message(self.proc.stdin, job)
            return self._answer(deadline)
        except (BrokenPipeError, ValueError, OSError) as exc:  # killed under us: pipes closed or gone
            raise RenderCrashed() from exc


class _Running:
    """The process a job runs on, so that cancelling the job can kill it."""

    def __init__(self) -> None:
        self.process: _RenderProcess | None = None
        self.cancelled = False
        self.lock = threading.Lock()

    def kill(self) -> None:
        with self.lock:
            self.cancelled = True
            process = self.process
        if process is not None:
            process.kill()


class RenderLane:
    def __init__(self, name: str, num_processes: int, timeout_s: float, memory_mib: int, nice: int = 0):
        self.name = name
        self.nice = nice
        self.timeout_s = timeout_s
        self.memory_mib = memory_mib
        self.num_processes = num_processes
        self._executor = ThreadPoolExecutor(num_processes, thread_name_prefix=f"render-{name}")
        # Starts the replacements of killed processes while their threads take other work.
        self._starter = ThreadPoolExecutor(num_processes, thread_name_prefix=f"render-{name}-start")
        self._local = threading.local()  # .process: this thread's process, a Future while it starts
        self._processes: list[_RenderProcess] = []
        self._lock = threading.Lock()

    def _start(self) -> _RenderProcess:
        process = _RenderProcess(self.memory_mib, self.nice)
        with self._lock:
            self._processes = [p for p in self._processes if p.is_alive] + [process]
        return process

    def _process(self) -> _RenderProcess:
        """This thread's process: its replacement once started, or one started now when it has none alive."""
        process = getattr(self._local, "process", None)
        if isinstance(process, Future):
            try:
                process = self._local.process = process.result()
            except RenderCrashed:
                self._local.process = None
                raise
        if process is None or not process.is_alive:
            if process is not None:
                process.kill()  # reap it
            process = self._local.process = self._start()
        return process

    def _run(self, job: dict[str, Any], running: _Running) -> dict[str, Any]:
        process = self._process()  # may start one: outside the lock, which the event loop takes to cancel
        with running.lock:
            if running.cancelled:
                raise RenderCrashed()
            running.process = process
        try:
            return process.run(job, self.timeout_s)
        except (RenderTimeout, RenderCrashed) as exc:  # past its time, or killed for its cancelled request
            process.kill()
            with contextlib.suppress(RuntimeError):  # the lane is closing: no replacement
                self._local.process = self._starter.submit(self._start)
            if isinstance(exc, RenderTimeout):
                log.warning("a render in lane %s ran past %g s and was stopped", self.name, self.timeout_s)
            raise

    def warm_up(self) -> None:
        """Start every process of the lane now rather than on the first requests."""
        ping = {"template": "", "messages": [], "tools": None, "template_vars": {},
                "add_generation_prompt": False, "continue_final_message": False, "max_chars": 0}
        barrier = threading.Barrier(self.num_processes)

        def start() -> None:
            barrier.wait()  # one job per thread, so every thread starts its process
            self._run(ping, _Running())

        for future in [self._executor.submit(start) for _ in range(self.num_processes)]:
            future.result()

    async def render(self, job: dict[str, Any]) -> dict[str, Any]:
        """The worker's answer to `job`. Raises RenderTimeout or RenderCrashed;
        a cancelled caller stops the render."""
        running = _Running()
        future = asyncio.get_running_loop().run_in_executor(self._executor, self._run, job, running)
        try:
            return await future
        except asyncio.CancelledError:
            running.kill()
            raise

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._starter.shutdown(wait=True, cancel_futures=True)  # so that no start outlives the kill below
        with self._lock:
            processes, self._processes = self._processes, []
        for process in processes:
            process.kill()
