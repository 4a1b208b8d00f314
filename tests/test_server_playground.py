"""The playground page in a real headless browser (Debian's chromium driven by playwright): it loads, submits a
prompt, and shows the answer streaming in with accepted draft tokens highlighted and live speculation stats.

`make test` installs chromium first (`make browser`, apt-get as root); where that is impossible this test skips
and says so."""

from __future__ import annotations

import os

import httpx
import pytest
from server_thread import BackgroundServer

from specdecode.api import SpecDecoder
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

SMOL = "smollm2-135m-instruct"
CHROMIUM = "/usr/bin/chromium"
# Headless and quiet: no GPU, no sandbox (containers run as root), no calls home.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
PROMPT = "Repeat this line three times: the cat sat on the mat."

pytestmark = pytest.mark.e2e


def test_playground_streams_an_answer_with_accepted_drafts_highlighted():
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no browser at {CHROMIUM}: run `make browser` (installs Debian's chromium; needs root and "
                    "apt-get)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is missing: pip install -e '.[dev]'")
    # A fixed draft size: under test is the page, not whether this machine's cached cost curve (measured and
    # priced in use, perhaps while other tests ran) lets n-gram drafts pay on this prompt.
    decoder = SpecDecoder.load(SMOL, method="ngram", num_draft_tokens=4, dtype="float32", max_len=1024)
    app = create_app(decoder, ServerSettings(model_name=SMOL))
    with BackgroundServer(app) as url, sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            page.wait_for_function("document.getElementById('method').value === 'ngram'")
            page.fill("#prompt", PROMPT)
            page.fill("#max_tokens", "32")
            page.click("#send")
            page.wait_for_selector("#output span.accepted", timeout=60_000)
            page.wait_for_function("!document.getElementById('send').disabled", timeout=60_000)  # stream done
            shown = page.inner_text("#output")
            highlighted = page.locator("#output span.accepted").count()
            acceptance, tokens = page.inner_text("#acceptance"), page.inner_text("#tokens")
            assert page.inner_text("#error") == ""
        finally:
            browser.close()
        same = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": SMOL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32, "temperature": 0})
    answer = same.json()
    assert shown == answer["choices"][0]["message"]["content"]  # the page shows exactly the API's answer
    # The page's own counts: the API request above chose its draft sizes afresh, so its acceptance may differ.
    new_tokens, accepted_drafted = tokens.split(" ", 1)
    accepted = int(accepted_drafted.strip("()").split("/")[0])
    assert 0 < highlighted <= accepted
    assert acceptance.endswith("%") and int(new_tokens) == answer["usage"]["completion_tokens"]
