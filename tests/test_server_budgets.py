"""Per-client budgets of prompt tokens a minute (server/budgets.py): the bucket's arithmetic on a clock the test
moves, and the 429 with Retry-After that a client over its budget gets from the server."""

from __future__ import annotations

import httpx
import pytest
from server_thread import BackgroundServer
from test_server_scheduler import ScriptedDecoder

from specdecode.errors import SpecdecodeError
from specdecode.server.app import create_app
from specdecode.server.budgets import OverBudget, PromptTokenBudget
from specdecode.server.settings import ServerSettings


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_refills_at_the_budgets_rate_and_a_long_prompt_overdraws_it_once():
    clock = Clock()
    budget = PromptTokenBudget(600, clock)  # 10 tokens a second
    budget.charge("a", 500)
    budget.charge("a", 400)  # 100 left: a larger prompt still starts, and leaves a debt of 300
    with pytest.raises(OverBudget) as refused:
        budget.charge("a", 1)
    assert refused.value.retry_after_s == 31  # (300 owed + 1) / 10 per second, rounded up
    budget.charge("b", 600)  # another client has a bucket of its own
    clock.now = 30.0
    with pytest.raises(OverBudget):
        budget.charge("a", 1)  # 300 tokens back: the debt is repaid, nothing more yet
    clock.now = 31.0
    budget.charge("a", 5)
    clock.now = 1000.0
    budget.charge("a", 600)  # refilled, but never beyond a minute's worth
    with pytest.raises(OverBudget):
        budget.charge("a", 1)


def test_a_refused_request_costs_nothing_and_retry_after_is_at_least_a_second():
    clock = Clock()
    budget = PromptTokenBudget(60_000, clock)  # 1000 tokens a second
    budget.charge("a", 60_000)
    with pytest.raises(OverBudget) as refused:
        budget.charge("a", 10)
    assert refused.value.retry_after_s == 1
    clock.now = 0.5
    budget.charge("a", 10)  # 500 came back; the refused request took none of it


def test_over_budget_gets_429_with_retry_after_and_other_clients_go_on():
    decoder = ScriptedDecoder()
    decoder.allow()
    app = create_app(decoder, ServerSettings(model_name="m", client_prompt_tokens_per_minute=12,
                                             api_keys=("alpha", "beta")))
    body = {"model": "m", "prompt": "0123456789", "max_tokens": 3}  # 10 prompt tokens (ScriptedDecoder.encode)
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=10) as http:
        def post(key: str) -> httpx.Response:
            return http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})

        assert post("alpha").status_code == 200
        assert post("alpha").status_code == 200  # 2 tokens were left: it starts, and overdraws by 8
        refused = post("alpha")
        assert refused.status_code == 429 and 40 <= int(refused.headers["retry-after"]) <= 45  # (8 + 1) / 0.2 a s
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "12 prompt tokens a minute" in error["message"]
        assert post("beta").status_code == 200  # budgets are per client (here per API key)
        assert 'status="429"' in http.get("/metrics").text


def test_a_budget_below_one_token_is_refused():
    with pytest.raises(SpecdecodeError, match="client-prompt-tokens-per-minute"):
        ServerSettings(model_name="m", client_prompt_tokens_per_minute=0)
