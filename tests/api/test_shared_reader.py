"""api/shared_reader.py against a real Redis: one loop reads every followed stream; each follower
gets its own events once, in order, whether they came through the loop or through its own first
read; a follower that joins while the loop is blocked is not held back by that round; an outage
is reported until a round succeeds again."""

from __future__ import annotations

import anyio
import pytest
import redis.asyncio as aioredis

from api.shared_reader import SharedReader
from queues.connect import UNAVAILABLE
from queues.intake import Intake
from queues.records import Token
from queues.server import EmbeddedRedis
from tests.helpers.api import Worker


async def read_all(reader: SharedReader, follower, count: int, within_s: float = 10) -> list[str]:  # noqa: ANN001
    ids: list[str] = []
    with anyio.fail_after(within_s):
        while len(ids) < count:
            ids += [entry_id for entry_id, _event in await reader.next(follower, 50)]
    return ids


def test_many_followers_each_get_their_events_once_in_order(redis_url, worker: Worker):
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        reader = SharedReader(Intake(client, worker.keys.model), block_ms=200)
        async with anyio.create_task_group() as group:
            group.start_soon(reader.run)
            published: dict[str, list[str]] = {}
            got: dict[str, list[str]] = {}

            async def follow(rid: str, early: int, late: int) -> None:
                async with reader.follow(rid) as follower:
                    got[rid] = await read_all(reader, follower, early)  # through its own read, or the loop
                    await anyio.sleep(0.3)  # by now the loop reads for it
                    published[rid] += worker.publish(rid, *(Token(f"l{i}", [i]) for i in range(late)))
                    got[rid] += await read_all(reader, follower, late)

            for n in range(40):
                rid = f"r{n}"
                published[rid] = worker.publish(rid, *(Token(f"e{i}", [i]) for i in range(n % 3 + 1)))
            async with anyio.create_task_group() as followers:
                for n in range(40):
                    followers.start_soon(follow, f"r{n}", n % 3 + 1, n % 4 + 1)
            group.cancel_scope.cancel()
        assert got == published
        await client.aclose()

    anyio.run(go)


def test_a_newcomer_is_not_held_back_by_the_round_under_way(redis_url, worker: Worker):
    async def go() -> None:
        client = aioredis.Redis.from_url(redis_url)
        reader = SharedReader(Intake(client, worker.keys.model), block_ms=5000)  # a long blocking round
        async with anyio.create_task_group() as group:
            group.start_soon(reader.run)
            async with reader.follow("quiet"):
                await anyio.sleep(0.2)  # the loop now blocks for 5 s on "quiet" alone
                async with reader.follow("new") as follower:
                    worker.publish("new", Token("x", [1]))
                    with anyio.fail_after(2):  # well before the round ends
                        assert len(await read_all(reader, follower, 1)) == 1
            group.cancel_scope.cancel()
        await client.aclose()

    anyio.run(go)


def test_an_outage_is_reported_until_a_round_succeeds(tmp_path):
    server = EmbeddedRedis(tmp_path, appendonly=False).start()

    async def go() -> None:
        client = aioredis.Redis.from_url(server.url)
        reader = SharedReader(Intake(client, "m"), block_ms=100)
        async with anyio.create_task_group() as group:
            group.start_soon(reader.run)
            async with reader.follow("r") as follower:
                await anyio.sleep(0.3)
                assert follower.adopted
                server.process.kill()
                server.process.wait()
                with anyio.fail_after(15):
                    while True:
                        try:
                            await reader.next(follower, 100)
                        except UNAVAILABLE:
                            break
                for _ in range(3):  # not once: every call while Redis stays away
                    with pytest.raises(UNAVAILABLE):
                        await reader.next(follower, 100)
            group.cancel_scope.cancel()
        await client.aclose()

    try:
        anyio.run(go)
    finally:
        server.stop()
