"""Request parsing without a model: what is accepted, what is refused, and that every refusal names the field."""

from __future__ import annotations

import pytest

from specdecode.server.errors import ApiError
from specdecode.server.schemas import ChatRequest, CompletionRequest, parse_request, sampling_params

MSG = '"messages": [{"role": "user", "content": "hi"}]'


def refused(raw: str, cls=ChatRequest) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(raw.encode(), cls)
    assert info.value.status == 400
    return info.value


def test_accepts_openai_fields_neutral_values_and_extensions():
    req = parse_request(('{"model": "m", ' + MSG + ', "n": 1, "user": "u", "logprobs": false, "temperature": 0, '
                         '"max_completion_tokens": 5, "stop": "x", "num_draft_tokens": 2, "top_k": 3, '
                         '"stream": true, "stream_options": {"include_usage": true}}').encode(), ChatRequest)
    params = sampling_params(req, room=100, default_max_tokens=None)
    assert (params.max_new_tokens, params.stop, params.top_k, params.greedy) == (5, ["x"], 3, True)
    assert req.num_draft_tokens == 2 and req.stream_options.include_usage
    parts = parse_request(b'{"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", '
                          b'"text": "a"}, {"type": "text", "text": "b"}]}]}', ChatRequest)
    assert parts.message_dicts() == [{"role": "system", "content": "ab"}]
    assert parse_request(b'{"model": "m", "prompt": [[1, 2]]}', CompletionRequest).single_prompt() == [1, 2]


@pytest.mark.parametrize("raw, words", [
    ('{"model": "m", ' + MSG + ', "best_of": 3, "store": true}', "best_of=3, store=true"),
    ('{"model": "m", ' + MSG + ', "seed": "7"}', "seed: Input should be a valid integer"),
    ('{"model": "m", ' + MSG + ', "top_p": 0}', "top_p"),
    ('{"model": "m", ' + MSG + ', "stream_options": {"continuous": true}}', "stream_options.continuous"),
    ('{"model": "m", "messages": [{"role": "user"}]}', "messages.0.content: Field required"),
    ('{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages.0.content"),
])
def test_refusals_name_the_field(raw, words):
    assert words in refused(raw).message


def test_max_tokens_must_fit_the_window_and_defaults_fill_it():
    req = parse_request(b'{"model": "m", "prompt": "hi", "max_tokens": 11}', CompletionRequest)
    with pytest.raises(ApiError) as info:
        sampling_params(req, room=10, default_max_tokens=16)
    assert info.value.code == "context_length_exceeded"
    bare = parse_request(b'{"model": "m", "prompt": "hi"}', CompletionRequest)
    assert sampling_params(bare, room=10, default_max_tokens=16).max_new_tokens == 10
    assert sampling_params(bare, room=100, default_max_tokens=16).max_new_tokens == 16
    assert sampling_params(bare, room=100, default_max_tokens=None).max_new_tokens == 100
    assert bare.temperature == 1.0  # OpenAI's default: sampling, not greedy
