"""The HTTP server end to end: the official openai client against a live server on loopback (SmolLM2-135M with
n-gram drafting): both endpoints streamed and not, /metrics counters, every kind of bad input, the API key,
16 concurrent streaming clients equal to the same prompts one at a time, slow and disconnecting clients."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from server_thread import BackgroundServer

from specdecode.api import SpecDecoder
from specdecode.config import SamplingParams
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

SMOL = "smollm2-135m-instruct"
KEY = "test-key"
MAX_LEN = 512  # a small window, so "too long" inputs stay small too

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def url():
    decoder = SpecDecoder.load(SMOL, method="ngram", dtype="float32", max_len=MAX_LEN)
    app = create_app(decoder, ServerSettings(model_name=SMOL, api_key=KEY, max_body_bytes=64_000))
    with BackgroundServer(app) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def client(url):
    return OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
        yield c


def metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels without model/method) -> value."""
    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("model_name", "method")))
            out[s.name, labels] = s.value
    return out


def test_chat_and_completions_streamed_and_not(client):
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=SMOL, messages=messages, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.content
    spec = whole.usage.speculative
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 5
    assert {"drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length"} <= spec.keys()
    assert spec["method"] == "ngram" and 0 <= spec["accepted_tokens"] <= spec["drafted_tokens"]

    chunks = list(client.chat.completions.create(model=SMOL, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: streaming changes nothing
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    # A fixed draft size: a cost curve measured under load (other tests running) may price every draft out
    fixed = {"num_draft_tokens": 4}
    done = client.completions.create(model=SMOL, prompt=prompt, max_tokens=8, temperature=0, extra_body=fixed)
    assert done.object == "text_completion" and 0 < done.usage.completion_tokens <= 8
    pieces = list(client.completions.create(model=SMOL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            extra_body=fixed))
    assert "".join(c.choices[0].text for c in pieces) == done.choices[0].text
    assert pieces[-1].choices[0].finish_reason == done.choices[0].finish_reason
    assert done.usage.speculative["accepted_tokens"] > 0  # n-gram drafting finds the repeated phrase


def test_stop_seed_and_draft_length(client):
    stopped = client.completions.create(model=SMOL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0,
                                        stop=[" 7"])
    assert stopped.choices[0].finish_reason == "stop" and " 7" not in stopped.choices[0].text
    kwargs = dict(model=SMOL, prompt="Once upon a time", max_tokens=8, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kwargs).choices[0].text == client.completions.create(**kwargs).choices[0].text
    plain = client.completions.create(model=SMOL, prompt="a b a b a b", max_tokens=6, temperature=0,
                                      extra_body={"num_draft_tokens": 0})
    assert plain.usage.speculative["drafted_tokens"] == 0 and plain.usage.speculative["num_draft_tokens"] == 0


def test_models_health_and_page(url, http, client):
    assert [m.id for m in client.models.list().data] == [SMOL]
    assert http.get(f"/v1/models/{SMOL}").json()["specdecode"]["method"] == "ngram"
    assert httpx.get(url + "/health").json()["status"] == "ok"
    page = httpx.get(url + "/")
    assert page.status_code == 200 and "specdecode playground" in page.text


def test_metrics_counters_move(client, http):
    before = metrics(http)
    out = client.completions.create(model=SMOL, prompt="red green blue red green blue red", max_tokens=8,
                                    temperature=0)
    after = metrics(http)
    delta = lambda name, **labels: after.get((name, tuple(sorted(labels.items()))), 0) - before.get(
        (name, tuple(sorted(labels.items()))), 0)
    spec = out.usage.speculative
    assert delta("specdecode:request_success_total", finished_reason=out.choices[0].finish_reason) == 1
    assert delta("specdecode:prompt_tokens_total") == out.usage.prompt_tokens
    assert delta("specdecode:generation_tokens_total") == out.usage.completion_tokens
    assert delta("specdecode:spec_decode_num_drafts_total") == spec["drafts"]
    assert delta("specdecode:spec_decode_num_draft_tokens_total") == spec["drafted_tokens"]
    assert delta("specdecode:spec_decode_num_accepted_tokens_total") == spec["accepted_tokens"]
    per_pos = sum(delta("specdecode:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                  for i in range(8))
    assert per_pos == spec["accepted_tokens"]
    for drafter, counts in spec["by_drafter"].items():  # acceptance per drafter, as hybrid's steps chose them
        assert delta("specdecode:spec_decode_num_draft_tokens_by_drafter_total", drafter=drafter) == counts["drafted"]
        assert delta("specdecode:spec_decode_num_accepted_tokens_by_drafter_total",
                     drafter=drafter) == counts["accepted"]
    for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert delta(f"specdecode:{hist}_count") == 1
    assert delta("specdecode:inter_token_latency_seconds_count") == out.usage.completion_tokens - 1
    assert after["specdecode:num_requests_running", ()] == 0 and after["specdecode:num_requests_waiting", ()] == 0


CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, status, words", [
    (CHAT, b'{"model": "smollm2', 400, "not valid JSON"),
    (CHAT, b'[1, 2]', 400, "JSON object"),
    (CHAT, b'{"model": ' + b'[' * 20_000 + b']' * 20_000 + b'}', 400, "nested too deeply"),
    (CHAT, {"model": SMOL}, 400, "messages: Field required"),
    (CHAT, {"messages": MSG}, 400, "model: Field required"),
    (CHAT, {"model": SMOL, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": SMOL, "messages": MSG, "max_tokens": "ten"}, 400, "max_tokens"),
    (CHAT, {"model": SMOL, "messages": MSG, "temperature": -1}, 400, "temperature"),
    (CHAT, {"model": SMOL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
    (CHAT, {"model": "gpt-9", "messages": MSG}, 404, "gpt-9"),
    (CHAT, {"model": SMOL, "messages": MSG, "max_tokens": MAX_LEN}, 400, "context window"),
    (CHAT, {"model": SMOL, "messages": [{"role": "user", "content": "word " * MAX_LEN}]}, 400, "context window"),
    (CHAT, {"model": SMOL, "messages": MSG, "best_of": 2, "suffix": "x"}, 400, "best_of=2, suffix"),
    (CHAT, {"model": SMOL, "messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"model": SMOL, "messages": MSG, "logit_bias": {"99999999": 1}}, 400, "outside the vocabulary"),
    (CHAT, {"model": SMOL, "messages": MSG, "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    (CHAT, {"model": SMOL, "messages": MSG, "logit_bias": {"x": 1}}, 400, "logit_bias.x"),
    (CHAT, {"model": SMOL, "messages": MSG, "n": 17}, 400, "n:"),
    (CHAT, {"model": SMOL, "messages": MSG, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CHAT, {"model": SMOL, "messages": MSG, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nope"}}}}, 400, "JSON schema is not supported"),
    (CHAT, {"model": SMOL, "messages": MSG, "response_format": {"type": "json_schema"}}, 400, "needs a json_schema"),
    (CHAT, {"model": SMOL, "messages": MSG, "response_format": {"type": "yaml"}}, 400, "response_format.type"),
    (CHAT, {"model": SMOL, "messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "not among the tools"),
    (CHAT, {"model": SMOL, "messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}}}}],
            "tool_choice": "required"}, 400, "not supported"),
    (CHAT, {"model": SMOL, "messages": MSG, "functions": [], "mirostat": 1}, 400, "functions, mirostat"),
    (CHAT, {"model": SMOL, "messages": MSG, "num_draft_tokens": 99}, 400, "num_draft_tokens"),
    (CHAT, {"model": SMOL, "messages": [{"role": "user", "content": "x" * 70_000}]}, 413, "larger than"),
    ("/v1/completions", {"model": SMOL, "prompt": ["a", "b"]}, 400, "one prompt per request"),
    ("/v1/completions", {"model": SMOL, "prompt": [1, 10**9]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"model": SMOL, "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    (CHAT, {"model": SMOL, "messages": MSG, "prediction": {"type": "content", "content": ""}}, 400,
     "prediction.content"),
    (CHAT, {"model": SMOL, "messages": MSG, "prediction": {"type": "content", "content": "word " * MAX_LEN}}, 400,
     "shorten the prediction"),
    (CHAT, {"model": SMOL, "messages": MSG, "prediction": {"type": "file", "content": "x"}}, 400, "prediction.type"),
])
def test_bad_input_gets_a_4xx_with_an_openai_error(http, path, body, status, words):
    r = http.post(path, content=body, headers=JSON) if isinstance(body, bytes) else http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"] and error["type"], error


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_only_json_bodies_are_taken(http, content_type):
    """A web page can post text/plain to a server it reaches without a CORS preflight: such bodies are refused."""
    body = json.dumps({"model": SMOL, "messages": MSG, "max_tokens": 1})
    r = http.post(CHAT, content=body, headers={"Content-Type": content_type} if content_type else {})
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert http.post(CHAT, content=body, headers={"Content-Type": "application/json; charset=utf-8"}).status_code == 200


def test_predicted_outputs_give_the_same_answer_and_count_the_prediction(client):
    """The prediction of an answer is copied where the answer follows it: same greedy answer, fewer forwards, and
    usage counts its accepted and rejected tokens as OpenAI does."""
    prompt = "Rewrite with the variable renamed to total:\n\ncount = 0\nfor x in items:\n    count += x\n"
    plain = client.completions.create(model=SMOL, prompt=prompt, max_tokens=40, temperature=0)
    text = plain.choices[0].text
    # a fixed draft size, as above: a cost curve cached under load may price every draft out
    predicted = client.completions.create(model=SMOL, prompt=prompt, max_tokens=40, temperature=0, extra_body={
        "prediction": {"type": "content", "content": text}, "num_draft_tokens": 8})
    assert predicted.choices[0].text == text
    details = predicted.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0.7 * plain.usage.completion_tokens
    assert details.rejected_prediction_tokens >= 0
    assert predicted.usage.speculative["mean_accepted_length"] > plain.usage.speculative["mean_accepted_length"]
    edited = text[: len(text) // 2] + " something else entirely " + text[len(text) // 2 :]
    chat = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": prompt}], max_tokens=40,
                                          temperature=0, prediction={"type": "content", "content": edited})
    alone = client.chat.completions.create(model=SMOL, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=40, temperature=0)
    assert chat.choices[0].message.content == alone.choices[0].message.content
    assert alone.usage.completion_tokens_details is None  # no prediction, no prediction counts


def test_a_next_turn_reuses_the_last_one_and_says_so(client, http):
    """A chat's second turn copies the first turn's prompt and answer from the prompt cache: usage reports them as
    OpenAI's cached tokens, /metrics counts them, and the answer is the one computed without them."""
    first = [{"role": "user", "content": "Name a color."}]
    one = client.chat.completions.create(model=SMOL, messages=first, max_tokens=10, temperature=0)
    turn = first + [{"role": "assistant", "content": one.choices[0].message.content},
                    {"role": "user", "content": "And another one?"}]
    before = metrics(http)
    two = client.chat.completions.create(model=SMOL, messages=turn, max_tokens=10, temperature=0)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert one.usage.prompt_tokens <= cached < two.usage.prompt_tokens
    assert metrics(http)[("specdecode:prompt_tokens_cached_total", ())] - before.get(
        ("specdecode:prompt_tokens_cached_total", ()), 0) == cached
    fresh = SpecDecoder.load(SMOL, method="ngram", dtype="float32", max_len=MAX_LEN, prompt_cache_mb=0)
    assert fresh.engine.prompt_cache is None
    assert fresh.generate(turn, SamplingParams(max_new_tokens=10), chat=True).text == two.choices[0].message.content


def test_api_key_is_required_on_v1(url, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        r = httpx.post(url + CHAT, json={"model": SMOL, "messages": MSG}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes and scrapers need no key
    assert client.models.list().data  # the right key passes


WORDS = "cat dog river mountain city piano garden ocean robot castle forest bridge library volcano desert island"
PROMPTS = [f"A short story about a {word}:" for word in WORDS.split()]


def test_16_concurrent_streams_equal_one_at_a_time(client, http):
    def ask(prompt: str, stream: bool) -> str:
        out = client.completions.create(model=SMOL, prompt=prompt, max_tokens=6, temperature=0, stream=stream)
        return "".join(c.choices[0].text for c in out) if stream else out.choices[0].text

    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = ask(PROMPTS[i], stream=True)
        except BaseException as e:  # reported below, in the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(results) == 16
    sequential = [ask(p, stream=False) for p in PROMPTS]
    assert [results[i] for i in range(16)] == sequential
    assert len(set(sequential)) >= 12  # mostly distinct answers, so a mix-up between clients would show


def test_slow_and_disconnected_clients_do_not_stall_others(url, http, client):
    aborted = ("specdecode:request_success_total", (("finished_reason", "abort"),))
    before = metrics(http)
    long = {"model": SMOL, "prompt": "Count: 1, 2, 3,", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as leaver:
        with leaver.stream("POST", "/v1/completions", json=long) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))  # generation has started
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 30
    while metrics(http).get(aborted, 0) == before.get(aborted, 0):
        assert time.monotonic() < deadline, "the disconnected request was not cancelled"
        time.sleep(0.2)
    tokens = "specdecode:generation_tokens_total", ()
    assert metrics(http)[tokens] - before[tokens] < 400  # stopped early

    # A client that never reads its stream holds only its own queue: the next request still completes.
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as sleeper:
        with sleeper.stream("POST", "/v1/completions", json=dict(long, max_tokens=12)):
            start = time.monotonic()
            out = client.completions.create(model=SMOL, prompt="Hello", max_tokens=4, temperature=0)
            assert out.choices[0].text and time.monotonic() - start < 60
    assert httpx.get(url + "/health").json()["status"] == "ok"
