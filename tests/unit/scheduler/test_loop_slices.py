"""Engines share the event loop's iterations (LoopSlices): under full load a
coroutine that needs many iterations (a gRPC stream's reader) keeps getting them."""
from __future__ import annotations

import asyncio
import time

from services.scheduler.engine import LoopSlices


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def run_engines(slices: LoopSlices | None, num_engines: int = 8, num_steps: int = 20):
    """`num_engines` tasks each doing `num_steps` steps of 0.3 ms, always ready
    (as engines whose worker answers at once); returns the steps each loop
    iteration ran, and how many iterations a bystander counting them got."""
    iteration = 0
    per_iteration: dict[int, int] = {}
    done = False

    async def bystander() -> int:  # one turn per iteration, as a stream reader awaiting message after message
        turns = 0
        while not done:
            await asyncio.sleep(0)
            turns += 1
        return turns

    def tick() -> None:
        nonlocal iteration
        iteration += 1
        if not done:
            asyncio.get_running_loop().call_soon(tick)

    async def engine() -> None:
        for _ in range(num_steps):
            await asyncio.sleep(0)  # the step's answer
            if slices is not None:
                await slices.take()
            per_iteration[iteration] = per_iteration.get(iteration, 0) + 1
            busy(3e-4)

    asyncio.get_running_loop().call_soon(tick)
    counting = asyncio.create_task(bystander())
    await asyncio.gather(*(engine() for _ in range(num_engines)))
    done = True
    return per_iteration, await counting


def test_an_iteration_runs_about_a_slice_of_steps_and_the_rest_wait_for_the_next():
    per_iteration, turns = asyncio.run(run_engines(LoopSlices(slice_s=5e-4)))
    assert sum(per_iteration.values()) == 8 * 20  # every step ran
    assert max(per_iteration.values()) <= 3  # 0.5 ms of 0.3 ms steps: the one that crosses it is the last
    free_per_iteration, free_turns = asyncio.run(run_engines(None))
    assert max(free_per_iteration.values()) == 8  # without: every ready engine in one iteration
    assert turns >= 3 * free_turns  # the bystander got its turns while the steps ran


def test_an_engine_stopped_while_it_waits_for_the_next_iteration_stops_no_other():
    async def main():
        slices = LoopSlices(slice_s=1e-4)

        async def engine() -> str:
            await slices.take()
            busy(2e-4)  # this iteration's slice is spent: its next step waits
            await slices.take()
            return "ran"

        stopped, other = asyncio.create_task(engine()), asyncio.create_task(engine())
        await asyncio.sleep(0)  # both wait for the next iteration now
        stopped.cancel()
        return await asyncio.gather(stopped, other, return_exceptions=True)

    stopped, other = asyncio.run(main())
    assert isinstance(stopped, asyncio.CancelledError) and other == "ran"
