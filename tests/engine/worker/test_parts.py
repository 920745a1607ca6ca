"""The worker's parts are built complete: what each runs by is given at construction (the engine
thread's cached-key limit, the heartbeat's routed block size and adapters, the intake's
data-loss hook), and the heartbeat alone writes `suspect`. The Redis cases run on a real
redis-server (6.2 and 7.x: the `client` fixture)."""

from __future__ import annotations

import redis.asyncio as aioredis

from common.protocol import REQUEST_FIELD, EngineRequest, Keys, OutputMessage
from common.protocol.heartbeat import MAX_CACHED
from common.redis_conn import Epoch
from common.sampling_params import SamplingParams
from engine.worker.failover import data_loss_hook
from engine.worker.heartbeat import Heartbeat
from engine.worker.intake import Intake
from engine.worker.outbox import Outbox
from engine.worker.parts import build_thread
from engine.worker.recovery import RecoveryState
from engine.worker.request_stream import RequestStream
from engine.worker.worker_config import WorkerConfig

KEYS = Keys("t")
MODEL = "m"


def test_the_engine_thread_lists_cached_keys_only_with_routing() -> None:
    for routing, limit in ((True, MAX_CACHED), (False, 0)):
        thread = build_thread(WorkerConfig(engine_id="e", model_name=MODEL, routing=routing), RecoveryState())
        try:
            assert thread.cached_limit == limit
        finally:
            thread.close()


def test_a_heartbeat_built_routed_announces_its_block_size_cached_keys_and_adapters() -> None:
    client = aioredis.Redis()  # never used: `build` talks to nobody
    routed = Heartbeat(client, KEYS, "e", MODEL, "/tok", 512, ttl_s=5.0, routed_block_size=16, loras=["sql"])
    sent = routed.build({"cached_keys": ["k1"]}, [], {})
    assert (sent.routed, sent.block_size, sent.cached, sent.loras) == (True, 16, ["k1"], ["sql"])
    plain = Heartbeat(client, KEYS, "e", MODEL, "/tok", 512, ttl_s=5.0).build({"cached_keys": ["k1"]}, [], {})
    assert (plain.routed, plain.block_size, plain.cached, plain.loras) == (False, 0, [], [])


async def test_suspect_is_set_by_a_late_beat_and_cleared_only_by_the_ownership_check(client: aioredis.Redis) -> None:
    beat = Heartbeat(client, KEYS, "e", MODEL, "/tok", 512, ttl_s=5.0)
    await beat.beat({}, [], {})
    assert not beat.suspect and beat.fresh(margin_s=1.0)
    beat.last_ok -= beat.ttl_s  # the last write is a whole TTL old: the key may have expired since
    await beat.beat({}, [], {})
    assert beat.suspect and not beat.fresh(margin_s=1.0)
    await beat.beat({}, [], {})  # an on-time beat does not clear it: others may own our work now
    assert beat.suspect
    beat.ownership_checked()
    assert not beat.suspect and beat.fresh(margin_s=1.0)


def _request(request_id: str, epoch: str) -> EngineRequest:
    return EngineRequest(id=request_id, gateway="gw", model=MODEL, prompt_token_ids=[1, 2, 3],
                         params=SamplingParams(max_tokens=8), arrival=0.0, epoch=epoch)


async def test_a_request_of_a_new_epoch_drops_every_request_and_tells_the_hook(client: aioredis.Redis) -> None:
    stream = RequestStream(client, KEYS, MODEL, "eng-a")
    await stream.ensure_group()
    epoch = Epoch(KEYS.epoch(MODEL))
    await epoch.check(client)
    assert epoch.token is not None
    recovery = RecoveryState()
    heard: list[set[str]] = []
    hook = data_loss_hook(recovery)

    def on_data_lost(lost: set[str]) -> None:
        heard.append(lost)
        hook(lost)

    intake = Intake(client, KEYS, stream, MODEL, epoch=epoch, on_data_lost=on_data_lost)
    await client.xadd(KEYS.requests(MODEL), {REQUEST_FIELD: _request("old", epoch.token).encode()})
    assert await intake.pull(10, None) == 1
    unsent = Outbox()
    unsent.add("gw", OutputMessage(id="old", seq=0, outputs=[]))
    recovery.note_unsent(unsent)
    await client.set(KEYS.epoch(MODEL), "after-a-restart")  # Redis came back without its data
    await client.xadd(KEYS.requests(MODEL), {REQUEST_FIELD: _request("new", "after-a-restart").encode()})
    assert await intake.pull(10, None) == 1
    assert heard == [{"old"}]
    assert set(intake.tracked) == {"new"} and "old" in intake.forced_aborts
    assert epoch.token == "after-a-restart" and not recovery.has_unsent
