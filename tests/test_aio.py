"""driver.aio.wait_event: an event wait with a timeout that never loses a cancellation.

The race: the event is set and the waiting task cancelled in the same loop iteration, as
when a slice watch event wakes the publisher just as Plugin.stop() cancels it. On Python
3.10/3.11 `asyncio.wait_for` then returns normally and the loop around it carries on."""

from __future__ import annotations

import asyncio
import pathlib
import sys

import pytest

from driver.aio import wait_event

ROOT = pathlib.Path(__file__).resolve().parent.parent


async def _wait_for(event: asyncio.Event, timeout: float | None) -> bool:
    """The pattern wait_event replaced, kept here to show the race is the real one."""
    try:
        await asyncio.wait_for(event.wait(), timeout)
        return True
    except asyncio.TimeoutError:
        return False


def _cancel_while_woken(wait) -> tuple[bool, int]:
    """A loop of waits, as the publisher has; set its event and cancel it in one loop
    iteration. Returns (the task ended cancelled, how many wakes the loop handled)."""

    async def scenario() -> tuple[bool, int]:
        event = asyncio.Event()
        wakes = 0

        async def loop_forever() -> None:
            nonlocal wakes
            while True:
                if await wait(event, 3600):
                    wakes += 1
                event.clear()

        task = asyncio.create_task(loop_forever())
        for _ in range(3):  # let it reach its wait
            await asyncio.sleep(0)
        event.set()
        task.cancel()
        await asyncio.wait((task,), timeout=1.0)
        ended = task.done() and task.cancelled()
        if not task.done():
            task.cancel()  # a second cancel reaches it: only the first was lost
            await asyncio.wait((task,), timeout=1.0)
        return ended, wakes

    return asyncio.run(scenario())


def test_wait_event_delivers_a_cancellation_that_arrives_with_the_wake():
    ended, wakes = _cancel_while_woken(wait_event)
    assert ended, "the cancelled task went on waiting"
    assert wakes == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="wait_for keeps the cancellation since 3.12")
def test_the_race_is_real_asyncio_wait_for_loses_that_cancellation():
    ended, wakes = _cancel_while_woken(_wait_for)
    assert not ended and wakes == 1, "if wait_for kept it, the scenario above tests nothing"


def test_wait_event_reports_set_and_timeout():
    async def scenario() -> tuple[bool, bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_event(event, 0.01)
        asyncio.get_running_loop().call_later(0.01, event.set)
        woken = await wait_event(event, 5)
        already = await wait_event(event, 0)  # set before the call: True even at timeout 0
        return timed_out, woken, already

    assert asyncio.run(scenario()) == (False, True, True)


def test_wait_event_leaves_no_task_behind():
    async def scenario() -> int:
        event = asyncio.Event()
        for _ in range(5):
            await wait_event(event, 0)
        await asyncio.sleep(0)  # let the cancelled inner waits finish
        return len([t for t in asyncio.all_tasks() if t is not asyncio.current_task()])

    assert asyncio.run(scenario()) == 0


def test_the_driver_waits_on_events_through_wait_event_only():
    users = [str(path.relative_to(ROOT)) for path in (ROOT / "driver").rglob("*.py")
             if "_proto" not in path.parts and path.name != "aio.py"
             and "asyncio.wait_for(" in path.read_text()]
    assert users == [], "asyncio.wait_for loses cancellations on Python < 3.12; use driver.aio.wait_event"
