"""Graceful drain: what a process carries when SIGTERM comes, and how it ends.

Every service drains the same way (Kubernetes sends SIGTERM, waits
terminationGracePeriodSeconds, then SIGKILLs):
1. `begin`: the service says it is not ready (HTTP 503 on /health, gRPC
   health NOT_SERVING) and refuses new work (HTTP 503, gRPC UNAVAILABLE),
   while what is running goes on;
2. it waits until nothing is carried (`carrying` counts each call), up to
   `drain_timeout_s` (STORMSERVE_DRAIN_TIMEOUT_S, one setting for all services);
3. at the timeout, `expire` ends what is left with a clear error (each call
   registered with `carrying(task)` has its task cancelled and turns that
   into an UNAVAILABLE status naming the timeout), never a silent cut;
4. the process exits 0.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from services.common.config import require, setting
from services.common.errors import ServiceError, drain_expired, drain_refused

log = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 30.0
MAX_DRAIN_TIMEOUT_S = 3600.0
POLL_S = 0.05


def drain_timeout_setting() -> Any:
    """The `drain_timeout_s` field every service's config has (same env name everywhere)."""
    return setting(
        DEFAULT_DRAIN_TIMEOUT_S,
        f"seconds after SIGTERM that running requests may take to finish before they are ended with an "
        f"error, [0, {MAX_DRAIN_TIMEOUT_S:g}]; new requests are refused meanwhile",
    )


def check_drain_timeout(value: float) -> None:
    require(0 <= value <= MAX_DRAIN_TIMEOUT_S,
            f"drain_timeout_s must be in [0, {MAX_DRAIN_TIMEOUT_S:g}], got {value}")


class Drain:
    """The drain state of one process: `draining` once SIGTERM came, `expired`
    once the drain timeout has ended what was left."""

    def __init__(self, name: str = "the service"):
        self.name = name
        self.draining = False
        self.expired = False
        self.timeout_s: float | None = None
        self._carried = 0
        self._expiring: set[asyncio.Task] = set()
        self._listeners: set[Callable[[], None]] = set()

    @property
    def num_carried(self) -> int:
        return self._carried

    def refusal(self) -> str:
        return drain_refused(self.name)

    def expiry(self) -> str:
        return drain_expired(self.name, self.timeout_s)

    def refuse_new(self) -> None:
        """Raise UNAVAILABLE when draining (new work belongs on another replica)."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, self.refusal())

    def expiry_error(self) -> ServiceError:
        return ServiceError(grpc.StatusCode.UNAVAILABLE, self.expiry())

    @contextmanager
    def carrying(self, task: asyncio.Task | None = None, count: bool = True) -> Iterator[None]:
        """One piece of running work (counted when `count`); `task`, if given, is
        cancelled when the drain expires: the work should then raise `expiry_error`."""
        self._carried += count
        if task is not None:
            self._expiring.add(task)
        try:
            yield
        finally:
            self._carried -= count
            if task is not None:
                self._expiring.discard(task)

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when draining begins and when it expires; returns the remover."""
        self._listeners.add(callback)
        return lambda: self._listeners.discard(callback)

    def _notify(self) -> None:
        for callback in list(self._listeners):
            callback()

    def begin(self, timeout_s: float) -> None:
        self.draining, self.timeout_s = True, timeout_s
        self._notify()

    def expire(self) -> None:
        """End what is still running: each registered task is cancelled."""
        self.expired = True
        for task in list(self._expiring):
            task.cancel()
        self._notify()

    async def wait_idle(self, timeout_s: float, is_idle: Callable[[], bool] | None = None,
                        settle_s: float = 0.0) -> bool:
        """True once nothing is carried (and `is_idle()`) and has stayed so for
        `settle_s`; False when `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        idle_since = None
        while True:
            now = time.monotonic()
            if self._carried == 0 and (is_idle is None or is_idle()):
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= settle_s:
                    return True
            else:
                idle_since = None
            if now >= deadline:
                return False
            await asyncio.sleep(min(POLL_S, max(deadline - now, 0.0)))

    async def run(self, timeout_s: float, is_idle: Callable[[], bool] | None = None, settle_s: float = 0.0,
                  on_expiry: Callable[[], None] | None = None, final_s: float = 1.0) -> bool:
        """The whole drain: begin, wait for idle up to `timeout_s`, else expire
        (then `on_expiry()`) and give the ended work `final_s` to send its error.
        True when everything finished on its own. Logs what it did and how long it took."""
        started = time.monotonic()
        carried = self._carried
        # A service with its own idea of idle (the worker: sequences held) counts no calls.
        what = f"{carried} requests in flight" if is_idle is None else "until idle"
        self.begin(timeout_s)
        log.info("%s draining: %s, up to %g s", self.name, what, timeout_s)
        drained = await self.wait_idle(timeout_s, is_idle, min(settle_s, timeout_s))
        if not drained:
            log.warning("%s: drain timeout (%g s) passed with %d in flight; ending them with an error",
                        self.name, timeout_s, self._carried)
            self.expire()
            if on_expiry is not None:
                on_expiry()
            await self.wait_idle(final_s)
        log.info("%s drained in %.2f s (%s%s)", self.name, time.monotonic() - started,
                 what, "" if drained else "; what was left ended by the timeout")
        return drained
