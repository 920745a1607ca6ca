"""Progress checkpoints stay bounded (issue 24), on a real redis-server: a long generation keeps at
most CHECKPOINT_ENTRIES entries of this engine in its list, its bytes grow with tokens rather than
steps, and folding the list gives exactly the tokens sent after every step; a resumed request
keeps its earlier engine's entries; a repeated flush and an ended request behave."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from common.protocol import Keys, OutputMessage, SeqOutput, TokenLogprob, merge_progress
from engine.worker.checkpoints import CheckpointLog
from engine.worker.outbox import Outbox, flush

KEYS = Keys("ckpt")
STREAM = KEYS.requests("m")
LIMIT = 8


@pytest.fixture
async def client(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server)
    await client.delete(*(KEYS.progress("gw", r) for r in ("long", "resumed", "again", "ends")), KEYS.out("gw"))
    yield client
    await client.aclose()


class Generation:
    """Steps of an n=2 request with logprobs, and the tokens each choice has been sent."""

    def __init__(self, request_id: str, seed: int, sent: dict[int, list[int]] | None = None) -> None:
        self.request_id, self.rng, self.seq = request_id, random.Random(seed), 0
        self.sent = sent or {0: [], 1: []}

    def step(self, finish: bool = False) -> OutputMessage:
        outputs = []
        for index, tokens in self.sent.items():
            new = [self.rng.randrange(50_000) for _ in range(self.rng.randint(1, 4))]
            outputs.append(SeqOutput(index=index, token_ids=new, offset=len(tokens),
                                     finish_reason="length" if finish else None,
                                     logprobs=[TokenLogprob(-0.5, [(t, -0.5), (7, -2.0)]) for t in new]))
            tokens.extend(new)
        message = OutputMessage(id=self.request_id, seq=self.seq, outputs=outputs)
        self.seq += 1
        return message


async def send(client: aioredis.Redis, message: OutputMessage, log: CheckpointLog | None) -> None:
    box = Outbox()
    box.add("gw", message)
    await flush(client, KEYS, STREAM, box, 60, [], log=log)


async def entries(client: aioredis.Redis, request_id: str) -> list[bytes]:
    return list(await client.lrange(KEYS.progress("gw", request_id), 0, -1))


async def test_a_long_generation_stays_bounded_and_resumes_exactly(client: aioredis.Redis) -> None:
    log, gen = CheckpointLog(LIMIT), Generation("long", 1)
    unbounded = 0
    for _ in range(300):
        message = gen.step()
        unbounded += len(message.checkpoint().encode())
        await send(client, message, log)
        listed = await entries(client, "long")
        assert len(listed) <= LIMIT
        progress = merge_progress(listed)
        assert progress.token_ids == gen.sent and progress.last_seq == gen.seq - 1
    tokens = sum(len(t) for t in gen.sent.values())
    stored = sum(len(e) for e in await entries(client, "long"))
    assert stored < 4 * tokens + LIMIT * 120 and stored < unbounded / 5, (stored, tokens, unbounded)
    await send(client, gen.step(finish=True), log)
    assert merge_progress(await entries(client, "long")).finished == {0: "length", 1: "length"}


async def test_a_resumed_request_keeps_its_earlier_engines_entries(client: aioredis.Redis) -> None:
    earlier = Generation("resumed", 2)
    for _ in range(5):  # an engine that died, unbounded
        await send(client, earlier.step(), None)
    before = await entries(client, "resumed")
    resumed = Generation("resumed", 3, merge_progress(before).token_ids)
    resumed.seq = earlier.seq
    log = CheckpointLog(LIMIT)
    for _ in range(40):
        await send(client, resumed.step(), log)
        listed = await entries(client, "resumed")
        assert listed[:5] == before and len(listed) <= 5 + LIMIT
        assert merge_progress(listed).token_ids == resumed.sent


async def test_a_repeated_flush_still_folds_to_the_same_tokens(client: aioredis.Redis) -> None:
    """A flush sent twice (its replica did not confirm) leaves extra entries, never a gap."""
    log, gen = CheckpointLog(LIMIT), Generation("again", 4)
    for step in range(60):
        message = gen.step()
        await send(client, message, log)
        if step % 7 == 0:
            await send(client, message, log)
        listed = await entries(client, "again")
        assert merge_progress(listed).token_ids == gen.sent and len(listed) <= 2 * LIMIT


async def test_an_ended_request_leaves_nothing_behind(client: aioredis.Redis) -> None:
    log, gen = CheckpointLog(LIMIT), Generation("ends", 5)
    for _ in range(20):
        await send(client, gen.step(), log)
    assert len(log) == 1
    box = Outbox()
    box.add("gw", gen.step(finish=True))
    box.end("ends", "0-1")
    await flush(client, KEYS, STREAM, box, 60, [], log=log)
    assert len(log) == 0 and not await client.exists(KEYS.progress("gw", "ends"))
