"""The cache-aware router: longest match, the load rule, the shared fallback, skipped engines,
hints of this gateway's own decisions."""

from __future__ import annotations

import time

import pytest

from common.block_hash import prefix_keys
from common.protocol import EngineHeartbeat, Keys
from gateway.broker.router import Router

KEYS = Keys("t")
BS = 4
PROMPT_A = list(range(100, 140))  # 40 tokens: 9 reusable blocks of 4
PROMPT_B = list(range(500, 540))


def beat(engine_id: str, cached: list[int], waiting: float = 0, running: float = 0, model: str = "m",
         routed: bool = True, draining: bool = False, age_s: float = 0.0, usage: float = 0.1,
         block_size: int = BS) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, model=model, tokenizer="/tok", max_model_len=512,
                           time=time.time() - age_s,
                           stats={"waiting": waiting, "running": running, "usage_ratio": usage}, draining=draining,
                           routed=routed, block_size=block_size, cached=cached)


def router(*beats: EngineHeartbeat, slack: float = 4.0, hints: int = 1000) -> Router:
    r = Router(KEYS, load_slack=slack, hint_size=hints)
    r.refresh(list(beats))
    return r


def test_longest_prefix_wins() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys[:3]), beat("e2", keys[:7]), beat("e3", prefix_keys(PROMPT_B, BS)))
    route = r.choose("m", PROMPT_A)
    assert (route.engine_id, route.reason, route.matched_blocks) == ("e2", "prefix", 7)
    assert route.stream == KEYS.routed("m", "e2")
    assert r.counts == {"prefix": 1, "load": 0, "shared": 0}


def test_match_counts_leading_blocks_only() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    # e1 holds blocks 2..8 but not block 0: nothing of this prompt is reusable there
    r = router(beat("e1", keys[1:]), beat("e2", keys[:1]))
    assert r.choose("m", PROMPT_A).engine_id == "e2"


def test_load_override_past_the_slack() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys, waiting=6, running=4), beat("e2", [], running=5), slack=4)
    route = r.choose("m", PROMPT_A)
    assert (route.engine_id, route.reason) == ("e2", "load")
    # within the slack the prefix wins
    r = router(beat("e1", keys, waiting=4, running=4), beat("e2", [], running=5), slack=4)
    assert r.choose("m", PROMPT_A).reason == "prefix"


def test_full_kv_pool_counts_as_load() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys, running=1, usage=0.97), beat("e2", [], running=0), slack=2)
    assert r.choose("m", PROMPT_A).engine_id == "e2"


def test_requests_sent_since_the_heartbeat_count_as_load() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys), beat("e2", []), slack=1)
    chosen = [r.choose("m", PROMPT_A).engine_id for _ in range(3)]
    assert chosen == ["e1", "e1", "e2"]  # the third: e1 is 2 above e2 > slack 1


def test_no_match_places_on_the_least_loaded_and_shared_without_candidates() -> None:
    r = router(beat("e1", [], running=3), beat("e2", [], running=1))
    route = r.choose("m", PROMPT_A)
    assert (route.engine_id, route.reason) == ("e2", "load")
    shared = router(beat("e1", [], routed=False)).choose("m", PROMPT_A)
    assert (shared.engine_id, shared.reason, shared.stream) == (None, "shared", KEYS.requests("m"))
    assert router().choose("m", PROMPT_A).reason == "shared"


@pytest.mark.parametrize("skip", [{"routed": False}, {"draining": True}, {"age_s": 10.0}])
def test_unrouted_draining_and_stale_engines_are_skipped(skip: dict[str, object]) -> None:
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys, **skip), beat("e2", []))  # type: ignore[arg-type]
    route = r.choose("m", PROMPT_A)
    assert (route.engine_id, route.reason) == ("e2", "load")


def test_models_are_routed_apart() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys, model="a"), beat("e2", [], model="b"))
    assert r.choose("b", PROMPT_A).engine_id == "e2"
    assert r.choose("a", PROMPT_A).engine_id == "e1"
    assert r.choose("c", PROMPT_A).reason == "shared"


def test_hint_routes_the_next_turn_before_a_heartbeat_confirms() -> None:
    r = router(beat("e1", []), beat("e2", [], running=1))
    first = r.choose("m", PROMPT_A)
    assert first.engine_id == "e1"
    # the same conversation's next turn (its history then more) follows, though no heartbeat has it yet
    r.refresh([beat("e1", [], running=1), beat("e2", [])])
    turn2 = r.choose("m", PROMPT_A + [7] * 12)
    assert (turn2.engine_id, turn2.reason, turn2.matched_blocks) == ("e1", "prefix", 9)
    # a new conversation goes to the less loaded engine
    assert r.choose("m", PROMPT_B).engine_id == "e2"


def test_hint_dropped_when_its_engine_dies_or_a_heartbeat_confirms() -> None:
    r = router(beat("e1", []), beat("e2", [], running=1))
    assert r.choose("m", PROMPT_A).engine_id == "e1"
    r.refresh([beat("e2", [])])  # e1 gone
    assert r.choose("m", PROMPT_A).reason == "load"
    assert r.models["m"].hints and all(set(sent) == {"e2"} for sent in r.models["m"].hints.values())
    confirmed = prefix_keys(PROMPT_A, BS)
    time.sleep(0.01)
    r.refresh([beat("e2", confirmed)])
    assert not r.models["m"].hints  # the heartbeat speaks for them now
    assert r.choose("m", PROMPT_A).reason == "prefix"


def test_conversations_sharing_an_opening_each_follow_their_own_engine() -> None:
    """Two conversations opening with the same block (a system prompt, a chat template's header):
    the shared block is hinted for both engines, so each next turn still matches its own history
    (one engine per hinted key credited the shared block to the later engine only)."""
    r = router(beat("a", []), beat("b", []), slack=0)
    opening = PROMPT_A[:BS]
    x, y = opening + list(range(200, 220)), opening + list(range(300, 320))
    assert r.choose("m", x).engine_id == "a"
    assert r.choose("m", y).engine_id == "b"
    r.refresh([beat("a", []), beat("b", [])])
    turn2_x, turn2_y = r.choose("m", x + [9] * 8), r.choose("m", y + [9] * 8)
    assert (turn2_x.engine_id, turn2_x.reason, turn2_x.matched_blocks) == ("a", "prefix", 5)
    assert (turn2_y.engine_id, turn2_y.reason, turn2_y.matched_blocks) == ("b", "prefix", 5)


def test_hints_are_bounded() -> None:
    r = router(beat("e1", []), hints=5)
    r.choose("m", PROMPT_A)
    assert len(r.models["m"].hints) == 5


def test_engines_with_different_block_sizes_match_by_their_own_rule() -> None:
    r = router(beat("e1", prefix_keys(PROMPT_A, 8), block_size=8), beat("e2", prefix_keys(PROMPT_A, 4)[:2]))
    route = r.choose("m", PROMPT_A)
    assert (route.engine_id, route.matched_blocks) == ("e1", 4)


def test_two_routers_with_the_same_view_agree() -> None:
    keys = prefix_keys(PROMPT_A, BS)
    beats = [beat("e2", keys[:4]), beat("e1", keys[:4])]
    assert router(*beats).choose("m", PROMPT_A).engine_id == router(*reversed(beats)).choose("m", PROMPT_A).engine_id


def test_refresh_with_the_same_list_is_a_no_op() -> None:
    beats = [beat("e1", [])]
    r = router(*beats)
    r.choose("m", PROMPT_A)
    r.refresh(beats)
    assert r.load("m", "e1") == 1


def test_a_finished_request_stops_counting_at_once() -> None:
    """`done` takes a request off its engine's load before any heartbeat says so: the next turn
    of a conversation sent the moment its previous one ended follows its history."""
    keys = prefix_keys(PROMPT_A, BS)
    r = router(beat("e1", keys), beat("e2", []), slack=1)
    assert [r.choose("m", PROMPT_A).engine_id for _ in range(2)] == ["e1", "e1"]
    r.done("m", "e1")
    r.done("m", "e1")
    assert r.load("m", "e1") == 0 and r.outstanding == {}
    assert r.choose("m", PROMPT_A).reason == "prefix"


def test_a_stale_heartbeat_does_not_count_this_gateways_finished_requests() -> None:
    """A heartbeat taken while this gateway's request still ran, read after it ended, counts it as
    running: the router takes this gateway's own requests off the heartbeat's load at its time."""
    r = router(beat("e1", []), beat("e2", []), slack=0)
    assert r.choose("m", PROMPT_A).engine_id == "e1"
    stale = beat("e1", prefix_keys(PROMPT_A, BS), running=1)  # its time: now, with the request running
    time.sleep(0.01)
    r.done("m", "e1")  # ended after the heartbeat
    r.refresh([stale, beat("e2", [])])
    assert r.load("m", "e1") == 0
    assert r.choose("m", PROMPT_A).engine_id == "e1"


def test_other_gateways_requests_count_through_the_heartbeat() -> None:
    r = router(beat("e1", []), beat("e2", []))
    r.choose("m", PROMPT_A)  # e1: one of ours
    time.sleep(0.01)
    r.refresh([beat("e1", [], waiting=2, running=2), beat("e2", [], running=1)])  # e1: ours + 3 others
    assert (r.load("m", "e1"), r.load("m", "e2")) == (4, 1)
    assert r.choose("m", PROMPT_B).engine_id == "e2"


def test_done_without_choose_is_ignored() -> None:
    r = router(beat("e1", []))
    r.done("m", "e1")
    assert r.outstanding == {} and r.load("m", "e1") == 0
