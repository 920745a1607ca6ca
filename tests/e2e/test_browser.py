"""The chat page and the live KV-cache page in headless Chromium, against a real
`pagedserve up` (tiny Llama, a 128-block KV cache, API key on). Screenshots go to
artifacts/screenshots/."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.browser_support import API_KEY, CHROMIUM_ARGS, SCREENSHOTS, Stack, find_chromium

playwright_sync = pytest.importorskip("playwright.sync_api")


@pytest.fixture(scope="module")
def chromium() -> str:
    path, why = find_chromium()
    if path is None:
        print(f"browser tests skipped: {why}")
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def long_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a 4096-token context: an answer of 1,900 tokens runs for seconds,
    so the Stop test never races the end of its own request (450 tokens could finish before
    the KV page's next snapshot). Same shapes, so the pool still has 128 blocks."""
    from tests.fixtures.models import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-long"), max_position_embeddings=4096)


@pytest.fixture(scope="module")
def stack(long_tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    up = Stack.start(long_tiny_dir, tmp_path_factory.mktemp("up"))
    try:
        yield up
    finally:
        up.stop()


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[Any]:
    with playwright_sync.sync_playwright() as pw:
        instance = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        try:
            yield instance
        finally:
            instance.close()


class Tab:
    """A page on the gateway that records every URL it requests."""

    def __init__(self, browser: Any, base: str, width: int = 1200, height: int = 860) -> None:
        self.base = base
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.page = self.context.new_page()
        self.urls: list[str] = []
        self.errors: list[str] = []
        self.page.on("request", lambda request: self.urls.append(request.url))
        self.page.on("pageerror", lambda error: self.errors.append(str(error)))
        self.page.set_default_timeout(30_000)

    def open(self, path: str, key: str | None = API_KEY) -> Tab:
        self.page.goto(self.base + path)
        if key is not None:
            self.page.eval_on_selector("#key-details", "d => { d.open = true; }")  # a 401 may open it too
            self.page.fill("#api-key", key)
            self.page.click("#key-form button[type=submit]")
        return self

    def stat(self, name: str) -> int:
        return int(self.page.text_content(f"[data-stat={name}]") or "0")

    def wait_stat(self, name: str, condition: str) -> None:
        element = f"document.querySelector('[data-stat={name}]')"
        self.page.wait_for_function(f"() => {{ const e = {element}; return e && Number(e.textContent) {condition}; }}")

    def shot(self, name: str) -> Path:
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        path = SCREENSHOTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path

    def close(self) -> None:
        self.context.close()
        assert all(url.startswith(self.base) or url.startswith("data:") for url in self.urls), self.urls
        assert not self.errors, self.errors


@pytest.fixture
def tabs(browser: Any, stack: Stack) -> Iterator[list[Tab]]:
    opened: list[Tab] = []
    yield opened
    for tab in opened:
        tab.close()


def new_tab(tabs: list[Tab], browser: Any, stack: Stack, path: str, **kwargs: Any) -> Tab:
    key = kwargs.pop("key", API_KEY)
    tab = Tab(browser, stack.url, **kwargs)
    tabs.append(tab)
    return tab.open(path, key)


def send(chat: Tab, text: str, max_tokens: int, ignore_eos: bool = False, n: int = 1) -> Any:
    page = chat.page
    page.wait_for_selector("#model option[value=tiny]", state="attached")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#n", str(n))
    page.set_checked("#ignore-eos", ignore_eos)
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    return page.locator("li.message.assistant").last


def test_chat_streams_an_answer(browser: Any, stack: Stack, tabs: list[Tab]) -> None:
    chat = new_tab(tabs, browser, stack, "/")
    # Recorded by the page itself as it changes, so a fast answer cannot slip between two polls.
    chat.page.evaluate("""() => { window.sawStreaming = false;
        new MutationObserver(() => {
            const a = [...document.querySelectorAll('li.assistant')].at(-1);
            if (a && a.getAttribute('aria-busy') === 'true' && a.querySelector('.content').textContent.length > 0
                && document.querySelector('#send').disabled && !document.querySelector('#stop').disabled) {
                window.sawStreaming = true; }
        }).observe(document.body, {subtree: true, childList: true, characterData: true, attributes: true}); }""")
    answer = send(chat, "Hello! Tell me about paged attention.", max_tokens=160, ignore_eos=True)
    chat.page.wait_for_selector("li.assistant[data-status=done]")
    assert chat.page.evaluate("window.sawStreaming")  # text arrived while busy, with send off and stop on
    stats = answer.locator(".answer-stats").text_content()
    assert "160 completion tokens" in stats and "TTFT" in stats and "tokens/s" in stats, stats
    assert answer.locator(".content").text_content()
    assert chat.page.locator("li.message.user .content").text_content() == "Hello! Tell me about paged attention."
    assert chat.page.evaluate("sessionStorage.getItem('pagedserve.apiKey')") == API_KEY
    chat.shot("chat")


def test_stop_aborts_and_the_engine_frees_the_blocks(browser: Any, stack: Stack, tabs: list[Tab]) -> None:
    kv = new_tab(tabs, browser, stack, "/kv")
    chat = new_tab(tabs, browser, stack, "/")
    send(chat, "Write a long story.", max_tokens=1900, ignore_eos=True)  # fits the 2,048-token pool
    chat.page.wait_for_selector("li.assistant[data-request-id]", state="attached")
    request_id = chat.page.get_attribute("li.assistant[data-request-id]", "data-request-id")
    row = kv.page.locator("table.tables tbody tr", has_text=request_id)
    row.first.wait_for()  # its block table is on the KV page
    kv.wait_stat("used", "> 0")
    engine = stack.engine_pid()
    os.kill(engine, signal.SIGSTOP)  # the answer cannot finish before Stop is clicked, however fast
    try:
        chat.page.click("#stop")
        chat.page.wait_for_selector("li.assistant[data-status=stopped]")
    finally:
        os.kill(engine, signal.SIGCONT)
    chat.page.wait_for_selector("li.assistant[data-status=stopped]")
    assert chat.page.is_enabled("#send") and chat.page.is_disabled("#stop")
    assert "stopped" in (chat.page.text_content("li.assistant .answer-stats") or "")
    row.first.wait_for(state="detached")
    kv.wait_stat("used", "=== 0")
    assert kv.stat("running") == 0
    kv.shot("kv-after-stop")


def test_kv_view_fills_and_empties(browser: Any, stack: Stack, tabs: list[Tab]) -> None:
    kv = new_tab(tabs, browser, stack, "/kv")
    kv.wait_stat("blocks", "=== 128")
    kv.wait_stat("used", "=== 0")
    with ThreadPoolExecutor(4) as pool:
        futures = stack.load(pool, 4, max_tokens=420, ignore_eos=True, n=2)
        kv.wait_stat("used", ">= 48")
        assert kv.page.locator("table.tables tbody tr").count() >= 2
        assert kv.page.locator("canvas.pool").get_attribute("aria-label").startswith("Block pool of 128 blocks")
        kv.shot("kv-filling")
        wait(futures, timeout=240)
        assert all(len(f.result()["choices"]) == 2 for f in futures)
    kv.wait_stat("used", "=== 0")
    kv.wait_stat("running", "=== 0")
    assert kv.page.locator("table.tables tbody tr").count() == 0
    assert "usage ratio" in (kv.page.text_content(".charts") or "")
    kv.shot("kv-empty")


def test_without_the_key_errors_are_shown(browser: Any, stack: Stack, tabs: list[Tab]) -> None:
    chat = new_tab(tabs, browser, stack, "/", key=None)
    alert = chat.page.locator("#error")
    alert.wait_for()
    assert "API key" in (alert.text_content() or "")
    assert chat.page.locator("#key-details").get_attribute("open") is not None
    kv = new_tab(tabs, browser, stack, "/kv", key=None)
    kv.page.wait_for_selector("#stream-state:has-text('API key needed')")
    kv.open("/kv")  # entering the key connects
    kv.wait_stat("blocks", "=== 128")


@pytest.mark.parametrize("path", ["/", "/kv"])
def test_narrow_screen(browser: Any, stack: Stack, tabs: list[Tab], path: str) -> None:
    tab = new_tab(tabs, browser, stack, path, width=390, height=844)
    tab.page.wait_for_selector("#model option[value=tiny]" if path == "/" else "[data-stat=blocks]",
                               state="attached")
    overflow = tab.page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 0, f"{path} scrolls sideways by {overflow}px at 390px"
    tab.shot(f"narrow-{'chat' if path == '/' else 'kv'}")
