"""The server's OpenAPI document tried as a new user's fuzzer would: schemathesis reads /openapi.json, generates
requests (schema-valid ones that reach real generation, and malformed ones) for every operation, and runs all its
checks: no 5xx, responses and status codes as documented, valid data served, invalid data refused."""

from __future__ import annotations

import pytest
from server_thread import BackgroundServer

from specdecode.api import SpecDecoder
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz test needs schemathesis (pip install -e .[dev])")
from hypothesis import HealthCheck, given, settings  # noqa: E402  (schemathesis brings hypothesis)
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

SMOL = "smollm2-135m-instruct"
MAX_LEN = 96  # a small window keeps every generated request short
UNEXPRESSIBLE = ("context_length_exceeded", "token_out_of_vocabulary", "unsupported_schema")
EXAMPLES = 25  # per operation and mode: bounded, about a minute in all

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def url():
    decoder = SpecDecoder.load(SMOL, method="ngram", dtype="float32", max_len=MAX_LEN)
    app = create_app(decoder, ServerSettings(model_name=SMOL, max_body_bytes=64_000))
    with BackgroundServer(app) as base_url:
        yield base_url


@schemathesis.check
def valid_data_served_unless_too_long(ctx, response, case):
    """positive_data_acceptance, with the exceptions docs/server.md documents, which JSON Schema cannot express: a
    schema-valid prompt can still overflow the context window (code context_length_exceeded), a logit_bias key
    name a token the vocabulary lacks (token_out_of_vocabulary), a JSON schema use what the grammar engine does not
    support, or a tool_choice name no tool (unsupported_schema)."""
    if response.status_code == 400 and response.json()["error"]["code"] in UNEXPRESSIBLE:
        return None
    return positive_data_acceptance(ctx, response, case)


def test_openapi_declares_the_request_bodies_and_the_metrics_text(url):
    schema = schemathesis.openapi.from_url(url + "/openapi.json").raw_schema
    for path in ("/v1/completions", "/v1/chat/completions"):
        post = schema["paths"][path]["post"]
        assert post["requestBody"]["required"] and {"200", "400", "404", "429", "503"} <= set(post["responses"])
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    chat = schema["components"]["schemas"]["ChatRequest"]
    assert chat["properties"]["model"]["enum"] == [SMOL] and "messages" in chat["required"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzing_every_operation_finds_nothing(url, mode):
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    failures, calls = [], 0
    for result in schema.get_all_operations():
        operation = result.ok()

        @given(operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            nonlocal calls
            calls += 1
            case.call_and_validate(excluded_checks=[positive_data_acceptance],
                                   additional_checks=[valid_data_served_unless_too_long], timeout=60)

        try:
            check()
        except Unsatisfiable:  # nothing to get wrong: an operation without parameters has no malformed form
            assert mode is GenerationMode.NEGATIVE
        except Exception as e:  # noqa: BLE001 - collect every operation's findings, then report them all
            failures.append(f"{operation.label}: {e}")
    assert calls > 0
    assert not failures, "\n\n".join(failures)
