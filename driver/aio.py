"""Waiting on an asyncio.Event with a timeout without losing a cancellation.

`asyncio.wait_for(event.wait(), timeout)` on Python 3.10 and 3.11 returns normally when
the event is set in the same loop iteration in which the waiting task is cancelled
(CPython gh-86296, fixed in 3.12 by a rewrite of wait_for): the cancellation is consumed,
a `while True` loop around the wait carries on, and whoever awaits the cancelled task
waits until the next timeout, or forever. It happened here: a slice watch event woke the
publisher just as `Plugin.stop()` cancelled it, and stop() hung for the resync interval.
`asyncio.wait` never swallows a cancellation of the task that awaits it, so everything
in the driver that waits on an event with a timeout goes through `wait_event`.
"""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """True when `event` is set within `timeout` seconds (None: no limit), else False.
    Always yields to the loop once, so a loop around it is a cancellation point."""
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait((waiter,), timeout=timeout)
    finally:
        waiter.cancel()
    return bool(done)


async def within(future: asyncio.Future, timeout: float | None):
    """The result of `future` once it is done within `timeout` seconds, else
    asyncio.TimeoutError; unlike asyncio.wait_for it never swallows a cancellation of the
    caller (see above), and it leaves `future` running on a timeout (the caller decides)."""
    done, _ = await asyncio.wait((future,), timeout=timeout)
    if not done:
        raise asyncio.TimeoutError
    return future.result()
