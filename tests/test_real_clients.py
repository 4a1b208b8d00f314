"""Real clients against a real server on loopback (SmolLM2-135M): the openai SDK, lm-evaluation-harness and
LangChain, as their users call them. Two servers run side by side, plain decoding (`none`) and prompt lookup
(`ngram`, tree drafts): greedy answers, logprobs, penalties, constrained JSON and tool calls must be the same on
both, token for token and bit for bit. The request shapes these clients send are in tests/clients/ (lm-eval's
tasks) and were captured from the installed versions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI
from pydantic import BaseModel, Field
from server_thread import BackgroundServer

from specdecode.api import SpecDecoder
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

SMOL = "smollm2-135m-instruct"
MAX_LEN = 1024
METHODS = ("none", "ngram")  # the baseline and a speculative method that drafts trees (cheap: no draft model)
TASKS = Path(__file__).parent / "clients" / "lm_eval_tasks"

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """method -> base URL (no API key: lm-eval sends `Bearer ` with an empty key unless OPENAI_API_KEY is set),
    plus "tokenizer": a folder with the tokenizer saved, which lm-eval loads offline."""
    out, running = {}, []
    try:
        for method in METHODS:
            decoder = SpecDecoder.load(SMOL, method=method, dtype="float32", max_len=MAX_LEN)
            server = BackgroundServer(create_app(decoder, ServerSettings(model_name=SMOL)))
            running.append(server)
            out[method] = server.start()
        folder = tmp_path_factory.mktemp("tokenizer")
        decoder.tokenizer.save_pretrained(folder)
        out["tokenizer"] = str(folder)
        out["encode"] = lambda text: decoder.tokenizer.encode(text, add_special_tokens=False)
        yield out
    finally:
        for server in running:
            server.stop()


@pytest.fixture(scope="module")
def clients(servers):
    return {m: OpenAI(base_url=servers[m] + "/v1", api_key="x", max_retries=0, timeout=120) for m in METHODS}


def validate(instance, schema: dict) -> None:
    """Valid under the JSON schema: jsonschema when installed (ray brings it), else its keys and their types."""
    try:
        import jsonschema
    except ImportError:
        types = {"string": str, "integer": int, "object": dict, "number": (int, float)}
        assert isinstance(instance, dict) and set(schema.get("required", ())) <= instance.keys()
        for key, value in instance.items():
            assert key in schema["properties"] and isinstance(value, types[schema["properties"][key]["type"]])
        return
    jsonschema.validate(instance, schema)


def on_both(clients, ask):
    """ask(client) on each server -> the two results, which must be equal."""
    plain, spec = (ask(clients[m]) for m in METHODS)
    assert plain == spec, f"none: {plain!r}\nngram: {spec!r}"
    return plain


def chat_logprobs(entries) -> list[tuple]:
    return [(e.token, e.logprob, tuple(e.bytes), tuple((t.token, t.logprob) for t in e.top_logprobs))
            for e in entries]


# A reply that repeats its prompt, so prompt lookup drafts and the verify forward's logprobs are the ones compared.
ECHO = [{"role": "user", "content": "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."}]


# Bounded strings and numbers: a 135M model left free may write digits until max_tokens.
class City(BaseModel):
    """A city and how many million people live there."""

    name: str = Field(max_length=40)
    population_millions: int = Field(ge=0, le=1000)


CITY_SCHEMA = City.model_json_schema() | {"additionalProperties": False}
CITY_Q = [{"role": "user", "content": "The largest city in France?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city.",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_Q = [{"role": "user", "content": "What's the weather in Paris?"}]


# --- the openai client ------------------------------------------------------------------------------------------

def test_chat_logprobs_streamed_and_not_equal_across_methods(clients):
    def ask(client):
        whole = client.chat.completions.create(model=SMOL, messages=ECHO, max_tokens=24, temperature=0,
                                               logprobs=True, top_logprobs=3)
        choice = whole.choices[0]
        entries = choice.logprobs.content
        assert len(entries) == whole.usage.completion_tokens - (choice.finish_reason == "stop")  # EOS: not content
        assert "".join(e.token for e in entries) == choice.message.content
        for e in entries:
            assert len(e.top_logprobs) == 3 and e.logprob <= 0
            tops = [t.logprob for t in e.top_logprobs]
            assert tops == sorted(tops, reverse=True)
            assert (e.token, e.logprob) == (e.top_logprobs[0].token, tops[0])  # greedy: the argmax, same float
            assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
        chunks = list(client.chat.completions.create(model=SMOL, messages=ECHO, max_tokens=24, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True))
        streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        assert chat_logprobs(streamed) == chat_logprobs(entries)
        return chat_logprobs(entries), whole.usage.speculative["accepted_tokens"]

    plain, spec = (ask(clients[m]) for m in METHODS)
    assert plain[0] == spec[0]  # tokens, logprobs and alternatives: bit for bit
    assert plain[1] == 0 and spec[1] > 0  # ngram did verify drafts


def test_n_choices_share_a_seed_and_one_usage(clients):
    client = clients["ngram"]
    kwargs = dict(model=SMOL, messages=[{"role": "user", "content": "Write a word."}], max_tokens=8,
                  temperature=1.0, n=3, seed=11)
    first = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    texts = [c.message.content for c in first.choices]
    assert len(set(texts)) > 1  # three samples, not one copied
    assert [c.message.content for c in client.chat.completions.create(**kwargs).choices] == texts

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True},
                                                 logprobs=True, top_logprobs=1))
    assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]  # each choice opens (with its role) in order
    streamed, tokens = {i: "" for i in range(3)}, {i: "" for i in range(3)}
    for c in chunks[:-1]:
        assert len(c.choices) == 1 and c.usage is None
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
        for e in c.choices[0].logprobs.content if c.choices[0].logprobs else []:
            tokens[c.choices[0].index] += e.token
    assert list(streamed.values()) == texts and list(tokens.values()) == texts
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == first.usage.completion_tokens
    assert first.usage.prompt_tokens == chunks[-1].usage.prompt_tokens  # the prompt counts once

    one = list(client.chat.completions.create(model=SMOL, messages=ECHO, max_tokens=5, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert [c for c in one if c.usage is not None] == [one[-1]] and one[-1].usage.completion_tokens <= 5


def test_completions_echo_prompt_logprobs(clients, servers):
    prompt = "The capital of France is"

    def ask(client):
        out = client.completions.create(model=SMOL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                        logprobs=2)
        choice, lp = out.choices[0], out.choices[0].logprobs
        assert choice.text.startswith(prompt)
        assert len(lp.tokens) == out.usage.prompt_tokens + out.usage.completion_tokens
        assert "".join(lp.tokens) == choice.text
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        pieces = list(client.completions.create(model=SMOL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                                logprobs=2, stream=True))
        assert "".join(p.choices[0].text for p in pieces) == choice.text
        streamed = [(t, v, o) for p in pieces if p.choices[0].logprobs
                    for t, v, o in zip(p.choices[0].logprobs.tokens, p.choices[0].logprobs.token_logprobs,
                                       p.choices[0].logprobs.text_offset)]
        assert streamed == list(zip(lp.tokens, lp.token_logprobs, lp.text_offset))
        plain = client.completions.create(model=SMOL, prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                          stream=True)  # echo without logprobs: the prompt still opens the text
        assert "".join(p.choices[0].text for p in plain) == choice.text
        return choice.text, lp.tokens, lp.token_logprobs, lp.top_logprobs

    on_both(clients, ask)

    ids = servers["encode"]("Question: How many legs does a cat have?\nAnswer: four")

    def loglikelihood(client):  # lm-eval's request, exactly
        out = client.completions.create(model=SMOL, prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                        logprobs=1, seed=1234)
        lp = out.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) + 1  # every prompt token 1:1, then the one generated
        return lp.token_logprobs

    on_both(clients, loglikelihood)


def test_penalties_and_logit_bias_change_the_greedy_answer_alike(clients, servers):
    prompt = "apple, banana, apple, banana, apple, banana,"

    def ask(**extra):
        def one(client):
            return client.completions.create(model=SMOL, prompt=prompt, max_tokens=10, temperature=0,
                                             **extra).choices[0].text
        return on_both(clients, one)

    plain = ask()
    assert ask(frequency_penalty=1.5) != plain
    assert ask(presence_penalty=2.0) != plain
    first = servers["encode"](plain)[0]
    banned = ask(logit_bias={str(first): -100})
    assert servers["encode"](banned)[0] != first
    assert ask(extra_body={"repetition_penalty": 1.5, "min_p": 0.1}) != plain


def test_response_format_json_schema_and_json_object(clients):
    schema = {"type": "json_schema", "json_schema": {"name": "City", "strict": True, "schema": CITY_SCHEMA}}

    def ask_schema(client):
        out = client.chat.completions.create(model=SMOL, messages=CITY_Q, max_tokens=40, temperature=0,
                                             response_format=schema)
        assert out.choices[0].finish_reason == "stop"
        validate(json.loads(out.choices[0].message.content), CITY_SCHEMA)
        return out.choices[0].message.content

    on_both(clients, ask_schema)

    def ask_object(client):
        out = client.chat.completions.create(
            model=SMOL, messages=[{"role": "user", "content": "Describe a cat as a JSON object."}], max_tokens=40,
            temperature=0, response_format={"type": "json_object"})
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
        return out.choices[0].message.content

    assert on_both(clients, ask_object).lstrip().startswith("{")

    parsed = clients["ngram"].chat.completions.parse(model=SMOL, messages=CITY_Q, max_tokens=40, temperature=0,
                                                     response_format=City)
    city = parsed.choices[0].message.parsed
    assert isinstance(city, City) and city.name
    with clients["ngram"].chat.completions.stream(model=SMOL, messages=CITY_Q, max_tokens=40, temperature=0,
                                                  response_format=City) as stream:
        assert stream.get_final_completion().choices[0].message.parsed == city


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_streamed_and_not(clients, tool_choice):
    def ask(client):
        out = client.chat.completions.create(model=SMOL, messages=WEATHER_Q, tools=[WEATHER, TIME], max_tokens=60,
                                             temperature=0, tool_choice=tool_choice, parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert len(calls) == 1 and choice.message.tool_calls[0].id.startswith("call_")
        name, arguments = calls[0]
        schema = {"get_weather": WEATHER, "get_time": TIME}[name]["function"]["parameters"]
        validate(json.loads(arguments), schema)
        if isinstance(tool_choice, dict):
            assert name == "get_weather"

        # The stream, put together as clients do: strings concatenated per tool call index.
        stream = client.chat.completions.create(model=SMOL, messages=WEATHER_Q, tools=[WEATHER, TIME],
                                                max_tokens=60, temperature=0, tool_choice=tool_choice,
                                                parallel_tool_calls=False, stream=True)
        role, built, reasons = "", {}, []
        for c in stream:
            delta = c.choices[0].delta
            role += delta.role or ""
            for call in delta.tool_calls or []:
                got = built.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                got["id"] += call.id or ""
                got["name"] += call.function.name or ""
                got["arguments"] += call.function.arguments or ""
            reasons.append(c.choices[0].finish_reason)
        assert role == "assistant" and reasons[-1] == "tool_calls"
        assert [(b["name"], b["arguments"]) for b in built.values()] == calls and built[0]["id"].startswith("call_")
        return calls

    on_both(clients, ask)


def test_parse_with_a_pydantic_tool(clients):
    import openai

    class GetWeather(BaseModel):
        city: str

    out = clients["ngram"].chat.completions.parse(model=SMOL, messages=WEATHER_Q, max_tokens=40, temperature=0,
                                                  tools=[openai.pydantic_function_tool(GetWeather)],
                                                  tool_choice="required", parallel_tool_calls=False)
    call = out.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


# --- lm-evaluation-harness ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def lm_eval_offline():
    with pytest.MonkeyPatch.context() as mp:  # before lm_eval (and datasets) read them
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.delenv("OPENAI_API_KEY", raising=False)
        import lm_eval
        from lm_eval.tasks import TaskManager

        yield lm_eval, TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(lm_eval_offline, model: str, model_args: dict, tasks: list[str], **extra) -> dict:
    lm_eval, tasks_from = lm_eval_offline
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, task_manager=tasks_from,
                                   log_samples=True, limit=4, bootstrap_iters=0, **extra)


def answers(result: dict, task: str) -> list:
    return [(s["doc_id"], s["resps"], s["filtered_resps"]) for s in result["samples"][task]]


def test_lm_eval_local_completions_same_on_both_methods(servers, lm_eval_offline):
    tasks = ["sd_arith_gen", "sd_facts_mc"]
    results = {}
    for method in METHODS:
        args = {"model": SMOL, "base_url": f"{servers[method]}/v1/completions", "tokenizer": servers["tokenizer"],
                "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1,
                "max_retries": 1, "batch_size": 1}
        results[method] = evaluate(lm_eval_offline, "local-completions", args, tasks)
    plain, spec = results["none"], results["ngram"]
    assert set(plain["results"]) == set(tasks)
    for task, metrics in (("sd_arith_gen", ["exact_match,strip"]), ("sd_facts_mc", ["acc,none", "acc_norm,none"])):
        assert len(plain["samples"][task]) == 4
        for metric in metrics:
            assert 0 <= plain["results"][task][metric] <= 1
            assert plain["results"][task][metric] == spec["results"][task][metric]
        assert answers(plain, task) == answers(spec, task)  # every generation, every loglikelihood
    lls = [resp[0][0] for s in plain["samples"]["sd_facts_mc"] for resp in s["resps"]]
    assert all(isinstance(ll, float) and ll < 0 for ll in lls)
    assert all(s["resps"][0][0] for s in plain["samples"]["sd_arith_gen"])  # it answered something


def test_lm_eval_local_chat_completions(servers, lm_eval_offline):
    results = {}
    for method in METHODS:
        args = {"model": SMOL, "base_url": f"{servers[method]}/v1/chat/completions", "num_concurrent": 1,
                "max_retries": 1}
        results[method] = evaluate(lm_eval_offline, "local-chat-completions", args, ["sd_arith_gen"],
                                   apply_chat_template=True)
    assert "exact_match,strip" in results["none"]["results"]["sd_arith_gen"]
    assert answers(results["none"], "sd_arith_gen") == answers(results["ngram"], "sd_arith_gen")


# --- LangChain ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(servers):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=servers["ngram"] + "/v1", api_key="x", model=SMOL, temperature=0, max_tokens=60,
                      max_retries=0, timeout=120)


def test_langchain_structured_output(chat_model):
    city = chat_model.with_structured_output(City).invoke(CITY_Q[0]["content"])
    assert isinstance(city, City) and city.name


def test_langchain_tool_call_round_trip(chat_model):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, unit: str = "celsius") -> str:
        """Get the current weather in a city."""
        return f"sunny, 21 degrees {unit} in {city}"

    # strict: no properties beyond the tool's (the small model would invent some); one call, not a list
    llm = chat_model.bind_tools([get_weather], tool_choice="get_weather", strict=True, parallel_tool_calls=False)
    messages = [HumanMessage("What's the weather in Paris?")]
    called = llm.invoke(messages)
    assert isinstance(called, AIMessage) and not called.invalid_tool_calls
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"]
    messages += [called, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    final = chat_model.bind_tools([get_weather]).invoke(messages)
    assert isinstance(final, AIMessage) and (final.content or final.tool_calls)
