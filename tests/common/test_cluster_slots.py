"""Every script and transaction touches one Redis Cluster hash slot: the slot of each key the
submit, claim and rate-limit scripts get, and of each key the engine's flush, heartbeat and
routed-stream cleanup queue in one MULTI, computed with redis-py's `key_slot`. Names with
colons, braces and non-ASCII characters included (a brace in a model name must not split its
keys over slots)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from common.engine_set import queue_beat, queue_removal
from common.protocol import EngineHeartbeat, Keys, OutputMessage, SeqOutput
from engine.worker.outbox import Outbox, _forgotten, _queue_model_writes, _queue_output
from gateway.api.ratelimit import RateLimiter
from gateway.broker.broker import Broker
from gateway.broker.router import Router

NAMES = ["tiny", "org/Model-7B:q4", "a{b}c", "}x{", "{}", "ünï:cödé", "m" * 200]
KEYS = Keys()


def _slots(keys: list[str]) -> set[int]:
    return {key_slot(k.encode()) for k in keys}


def _command_keys(args: tuple[Any, ...]) -> list[str]:
    """The keys of one queued command (DEL takes several; the rest here take theirs first)."""
    name = str(args[0]).upper()
    keys = args[1:] if name == "DEL" else args[1:2]
    return [k.decode() if isinstance(k, bytes) else str(k) for k in keys]


def _queued_keys(pipe: Any) -> list[str]:
    return [key for args, _ in pipe.command_stack for key in _command_keys(args)]


def _client() -> aioredis.Redis:
    return aioredis.Redis(port=1)  # never connects: commands are only queued


@pytest.mark.parametrize("model", NAMES)
@pytest.mark.parametrize("engine", NAMES[:3])
async def test_submit_script_keys_share_the_models_slot(model: str, engine: str) -> None:
    broker = Broker(_client(), KEYS, "gw")
    router = Router(KEYS, 1.0)
    broker.use_router(router, None)  # type: ignore[arg-type]
    router.refresh([EngineHeartbeat(engine_id=e, model=model, tokenizer="/t", max_model_len=64, time=1.0,
                                     routed=True, block_size=16) for e in (engine, "other")], now=1.0)
    assert len(broker.counted_streams(model)) == 3
    for stream in (KEYS.requests(model), KEYS.routed(model, engine)):
        assert len(_slots(broker.submit_keys(model, stream))) == 1


@pytest.mark.parametrize("model", NAMES)
@pytest.mark.parametrize("engine", NAMES)
def test_claim_and_cleanup_keys_share_the_models_slot(model: str, engine: str) -> None:
    # the claim script: a stream of the model and the dead engine's liveness key; the flush's model
    # transaction: hand-backs, acks on the shared and routed streams, the epoch, the fence (liveness)
    family = [KEYS.requests(model), KEYS.routed(model, engine), KEYS.routed_streams(model), KEYS.dead(model),
              KEYS.epoch(model), KEYS.alive(model, engine), KEYS.loras(model)]
    assert len(_slots(family)) == 1


@pytest.mark.parametrize("gateway", NAMES)
def test_each_flush_transaction_touches_one_slot(gateway: str) -> None:
    model = "m{1}"
    outbox = Outbox()
    for rid in ("r1", "r2", "gone"):
        outbox.add(gateway, OutputMessage(id=rid, seq=0, outputs=[SeqOutput(index=0, token_ids=[1], offset=0)]))
    outbox.add("another", OutputMessage(id="r3", seq=0, outputs=[SeqOutput(index=0, token_ids=[1], offset=0)]))
    outbox.end("r2", "1-1", KEYS.routed(model, "e"), gateway)
    outbox.end("r4", "1-2", gateway=gateway)
    outbox.forget_progress.append("gone")
    outbox.ack("1-3")
    outbox.requeue.append(b"x")
    ended = {rid for rid, _ in outbox.ended}
    forgotten = _forgotten(KEYS, outbox, ended)
    for name, messages in outbox.by_gateway.items():
        pipe = _client().pipeline(transaction=True)
        _queue_output(pipe, KEYS, name, messages, ended, 60, None, {})
        if forgotten.get(name):
            pipe.delete(*forgotten[name])
        pipe.get(KEYS.gateway(name))
        keys = _queued_keys(pipe)
        assert len(_slots(keys)) == 1 and KEYS.out(name) in keys
    assert set(forgotten) == {gateway}  # every ended request's checkpoints are found by its gateway
    pipe = _client().pipeline(transaction=True)
    _queue_model_writes(pipe, KEYS, KEYS.requests(model), outbox)
    pipe.get(KEYS.epoch(model))
    keys = [*_queued_keys(pipe), KEYS.alive(model, "e")]  # + the WATCHed fence
    assert len(_slots(keys)) == 1 and KEYS.routed(model, "e") in keys


@pytest.mark.parametrize("engine", NAMES)
def test_heartbeat_writes_one_slot_per_transaction(engine: str) -> None:
    from common.redis_slots import SlotBatch

    beat = EngineHeartbeat(engine_id=engine, model="tiny", tokenizer="/t", max_model_len=64, time=1.0)
    for queue in (lambda b: queue_beat(b, KEYS, beat, 1000), lambda b: queue_removal(b, KEYS, engine, "tiny")):
        batch = SlotBatch(_client())
        queue(batch)
        groups = batch.slots()
        # the liveness key (model's slot), the hash (engine's slot), the set member: each slot's
        # commands run as one transaction, the liveness key's first
        assert len(groups) == 3 and groups[key_slot(KEYS.alive("tiny", engine).encode())] == [0]
        hash_slot = key_slot(KEYS.engine(engine).encode())
        assert all(key_slot(str(batch.calls[i][1][0]).encode()) == hash_slot for i in groups[hash_slot])


def test_rate_limit_script_keys_share_a_slot() -> None:
    limiter = RateLimiter(_client(), "ps", None, None)  # type: ignore[arg-type]
    for bucket in ["anonymous", *(hashlib.sha256(name.encode()).hexdigest() for name in NAMES)]:  # its bucket ids
        assert len(_slots(list(limiter.bucket_keys(bucket)))) == 1
