"""Routing a LoRA adapter's requests: only engines announcing the adapter are candidates (the
shared stream when none does), and its prefix keys are the adapter's, not the base model's."""

from __future__ import annotations

import time

from common.block_hash import prefix_keys
from common.protocol import EngineHeartbeat, Keys
from gateway.broker.router import Router

KEYS = Keys("t")
BS = 4
PROMPT = list(range(100, 140))


def beat(engine_id: str, cached: list[int], loras: list[str], waiting: float = 0) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, model="m", tokenizer="/tok", max_model_len=512, time=time.time(),
                           stats={"waiting": waiting, "usage_ratio": 0.1}, routed=True, block_size=BS,
                           cached=cached, loras=loras)


def test_only_engines_holding_the_adapter_are_candidates() -> None:
    r = Router(KEYS)
    r.refresh([beat("e1", [], []), beat("e2", [], ["sql"], waiting=9), beat("e3", [], ["chat"])])
    assert r.choose("m", PROMPT, "sql").engine_id == "e2"  # the busiest, but the only one with "sql"
    assert r.choose("m", PROMPT).engine_id in ("e1", "e3")  # the base model goes anywhere, least loaded first
    shared = r.choose("m", PROMPT, "missing")
    assert shared.engine_id is None and shared.stream == KEYS.requests("m")


def test_adapter_prefix_keys_are_its_own() -> None:
    base_keys, sql_keys = prefix_keys(PROMPT, BS), prefix_keys(PROMPT, BS, "sql")
    assert not set(base_keys) & set(sql_keys)
    r = Router(KEYS)
    r.refresh([beat("e1", base_keys, ["sql"]), beat("e2", sql_keys[:3], ["sql"])])
    assert r.choose("m", PROMPT, "sql").engine_id == "e2"  # e1 holds the base model's blocks, not the adapter's
    assert r.choose("m", PROMPT).engine_id == "e1"


def test_heartbeat_round_trips_its_adapters() -> None:
    sent = beat("e1", [], ["sql", "chat"])
    assert EngineHeartbeat.from_hash(sent.to_hash()).loras == ["sql", "chat"]
    assert EngineHeartbeat.from_hash(beat("e2", [], []).to_hash()).loras == []
