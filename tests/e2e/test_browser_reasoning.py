"""The chat page shows a model's thinking apart from its answer: headless Chromium against a real
`pagedserve up` serving the scripted Qwen3-style model of tests/e2e/test_reasoning.py (its
template implies the qwen3 parser). The thinking streams into a collapsed "Thinking" section
above the answer; the answer box holds the answer alone, and only the answer goes back into the
conversation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser_support import Stack
from tests.e2e.test_browser import Tab, browser, chromium, new_tab, send, tabs
from tests.e2e.test_reasoning import QWEN3_TEMPLATE, RAW_ANSWER, SCRIPT, THOUGHT
from tests.fixtures.scripted_model import make_scripted_model_dir

__all__ = ["browser", "chromium", "tabs"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir: Path = make_scripted_model_dir(tmp_path_factory.mktemp("qwen3-scripted"), SCRIPT, QWEN3_TEMPLATE)
    up = Stack.start(model_dir, tmp_path_factory.mktemp("up-reasoning"), kv_cache_memory="16MiB")
    try:
        yield up
    finally:
        up.stop()


def test_thinking_shown_apart(browser: Any, stack: Stack, tabs: list[Tab]) -> None:
    chat = new_tab(tabs, browser, stack, "/")
    answer = send(chat, "Weather in Paris?", max_tokens=40)
    chat.page.wait_for_selector("li.assistant[data-status=done]")
    thinking = answer.locator("details.thinking")
    assert thinking.locator("summary").text_content() == "Thinking"
    assert thinking.get_attribute("open") is None  # collapsed
    assert thinking.locator(".thinking-text").text_content() == THOUGHT
    assert answer.locator(".answer-text").text_content() == RAW_ANSWER
    thinking.locator("summary").click()
    assert thinking.get_attribute("open") is not None
    with chat.page.expect_request("**/v1/chat/completions") as request:
        send(chat, "And tomorrow?", max_tokens=40)
    history = request.value.post_data_json["messages"]
    assert history[1] == {"role": "assistant", "content": RAW_ANSWER}  # the answer, not the thinking
    chat.page.wait_for_selector("li.assistant[data-status=done] >> nth=1")
    chat.shot("chat-thinking")
