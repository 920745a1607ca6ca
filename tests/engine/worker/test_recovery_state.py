"""RecoveryState: each piece of recovery state changes only through its methods."""

from __future__ import annotations

import threading

from hypothesis import given
from hypothesis import strategies as st

from common.protocol import OutputMessage
from engine.worker.outbox import Outbox
from engine.worker.recovery import RecoveryState


def _outbox(request_id: str) -> Outbox:
    box = Outbox()
    box.end(request_id, "1-0")
    return box


@given(st.lists(st.sampled_from(["trouble", "take"]), max_size=30))
def test_readopt_is_taken_once_per_run_of_troubles(events: list[str]) -> None:
    state = RecoveryState()
    due = False
    for event in events:
        if event == "trouble":
            state.note_redis_trouble()
            due = True
        else:
            assert state.take_readopt() is due
            due = False
    assert state.readopt_due is due


def test_troubles_from_two_threads_leave_exactly_one_readopt() -> None:
    """A heartbeat failure and a flush failure at once: one readopt, not two, not none."""
    state = RecoveryState()
    start = threading.Barrier(2)

    def note() -> None:
        start.wait()
        for _ in range(1000):
            state.note_redis_trouble()

    threads = [threading.Thread(target=note) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [state.take_readopt(), state.take_readopt()] == [True, False]


def test_a_flush_sent_during_a_data_loss_keeps_the_reset() -> None:
    state = RecoveryState()
    sending = state.note_unsent(_outbox("a"))
    state.data_lost()  # while the flush was in flight
    state.note_unsent(_outbox("b"))
    state.sent(sending)  # the old outbox's flush returns: what came after stays unsent
    assert state.unsent.ended == [("b", "1-0")]
    state.sent(state.unsent)
    assert not state.has_unsent


def test_lose_drops_unsent_and_checkpoints_of_those_requests() -> None:
    state = RecoveryState()
    state.note_unsent(_outbox("a"))
    state.note_unsent(_outbox("b"))
    state.checkpoints.plan(OutputMessage(id="a", seq=0, outputs=[]))
    state.lose({"a"})
    assert state.unsent.ended == [("b", "1-0")] and len(state.checkpoints) == 0


def test_a_snapshot_request_is_taken_once() -> None:
    state = RecoveryState()
    assert state.take_snapshot() and not state.take_snapshot()  # the first step takes one
    state.request_snapshot()
    state.request_snapshot()
    assert state.take_snapshot() and not state.take_snapshot()
