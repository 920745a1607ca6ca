"""After a failover the new master can lack the last writes the old one acknowledged: a finished
request's XACK/XDEL (its entry then stays pending under the engine for good, and its checkpoint
stays), or an XREADGROUP's reply (an entry delivered to the engine that never saw it). Found by
the Sentinel suite on a fast machine: 30-35 of 50 entries left behind after a kill -9 of the
master. `Intake.readopt` finds the entries pending under its name that it does not track, on a
real redis-server (6.2 and 7.x: the `client` fixture), without counting a delivery, and resumes or
acknowledges each by its checkpoint."""

from __future__ import annotations

import redis.asyncio as aioredis

from common.protocol import REQUEST_FIELD, EngineRequest, Keys, OutputMessage, SeqOutput
from common.sampling_params import SamplingParams
from engine.worker.intake import Intake
from engine.worker.request_stream import RequestStream

KEYS = Keys("t")
MODEL = "m"
STREAM = KEYS.requests(MODEL)


def _request(request_id: str) -> EngineRequest:
    return EngineRequest(id=request_id, gateway="gw", model=MODEL, prompt_token_ids=[1, 2, 3],
                         params=SamplingParams(max_tokens=8), arrival=0.0)


async def test_untracked_pending_entries_are_resumed_or_acknowledged(client: aioredis.Redis) -> None:
    stream = RequestStream(client, KEYS, MODEL, "eng-a")
    await stream.ensure_group()
    intake = Intake(client, KEYS, stream, MODEL)
    ids = {}
    for name in ("tracked", "finished", "unseen"):
        ids[name] = (await client.xadd(STREAM, {REQUEST_FIELD: _request(name).encode()})).decode()
    await intake.pull(1, None)  # "tracked": read and admitted as usual
    assert set(intake.tracked) == {"tracked"}
    await stream.read_new(2, None)  # delivered, but the replies are "lost": the engine never saw them
    done = OutputMessage(id="finished", seq=0, outputs=[SeqOutput(index=0, token_ids=[7, 7], offset=0,
                                                                  finish_reason="length")])
    await client.rpush(KEYS.progress("gw", "finished"), done.checkpoint().encode())  # its client got it all
    ids["deleted"] = (await client.xadd(STREAM, {REQUEST_FIELD: _request("deleted").encode()})).decode()
    await stream.read_new(1, None)
    await client.xdel(STREAM, ids["deleted"])  # pending, but the entry itself is gone

    assert await intake.readopt() == 3
    assert set(intake.tracked) == {"tracked", "unseen"}  # resumed (from nothing: no checkpoint)
    assert [job.request_id for job in intake.jobs] == ["tracked", "unseen"]
    pending = intake.take_pending()
    assert pending.ended == [("finished", ids["finished"])]  # acknowledged, checkpoint dropped
    assert pending.ack_only == [ids["deleted"]]
    rows = await client.xpending_range(STREAM, KEYS.group, min="-", max="+", count=10)
    assert {row["message_id"].decode(): row["times_delivered"] for row in rows} == {
        ids["tracked"]: 1, ids["finished"]: 1, ids["unseen"]: 1, ids["deleted"]: 1}  # no delivery counted
    assert await intake.readopt() == 2  # still pending until the flush: known ones are skipped again
    assert set(intake.tracked) == {"tracked", "unseen"} and len(intake.jobs) == 2
