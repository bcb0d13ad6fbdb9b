"""Token events cross from engine threads to the event loop in order, a wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

from switchyard.models.served import _Mailbox
from switchyard_spec import TokenEvent


def _event(rid: str, token: int, last: bool = False) -> TokenEvent:
    return TokenEvent(request_id=rid, token_id=token, finish_reason="length" if last else None)


def test_a_burst_from_another_thread_arrives_in_order_with_one_wake_up():
    async def run() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        box = _Mailbox.of(loop)
        assert _Mailbox.of(loop) is box  # one per loop
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(callback, *args):
            nonlocal wakeups
            wakeups += 1
            return real(callback, *args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        queues = [asyncio.Queue() for _ in range(3)]

        def engine_step() -> None:  # one step's events, sequence after sequence
            for token in range(5):
                for i, queue in enumerate(queues):
                    box.post(queue, _event(f"r{i}", token, last=token == 4))

        thread = threading.Thread(target=engine_step)
        thread.start()
        thread.join()  # the whole burst is posted before the loop runs again
        got = []
        for queue in queues:
            tokens = []
            while True:
                event = await asyncio.wait_for(queue.get(), timeout=5)
                tokens.append(event.token_id)
                if event.finish_reason is not None:
                    break
            got.append(tokens)
        return got, wakeups

    got, wakeups = asyncio.run(run())
    assert got == [[0, 1, 2, 3, 4]] * 3
    assert wakeups == 1


def test_events_posted_after_a_drain_wake_the_loop_again():
    async def run() -> list[int]:
        box = _Mailbox.of(asyncio.get_running_loop())
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        seen = []
        for token in range(3):  # a step, then the loop drains, then the next step
            threading.Thread(target=box.post, args=(queue, _event("r", token))).start()
            seen.append((await asyncio.wait_for(queue.get(), timeout=5)).token_id)
        return seen

    assert asyncio.run(run()) == [0, 1, 2]
