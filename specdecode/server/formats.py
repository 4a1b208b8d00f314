"""OpenAI response objects (completion, chat.completion and their stream chunks) built from engine output.

Three additions, all ignored by OpenAI clients: `usage.speculative` (the request's drafted / accepted counts,
acceptance rate, mean accepted length), llama-server's `timings` beside `usage` (whole answers and a stream's final
chunk) and, on stream chunks, `specdecode` = {pieces, from_draft, stats}: the text of each token and whether it was
an accepted draft token, which the playground highlights.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from specdecode.server.answers import Answer, Finished

DONE = "data: [DONE]\n\n"


@dataclass
class Meta:
    """What every object of one response repeats."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(stats: dict[str, Any] | list[dict[str, Any]], method: str, num_draft_tokens: int | None
          ) -> dict[str, Any]:
    """OpenAI usage plus `speculative`; `stats` is GenerationStats.to_dict(), or one per choice (n > 1: the prompt
    counts once, the completion tokens and draft counts add up)."""
    if isinstance(stats, list):
        stats = merged(stats)
    prompt, completion = stats["prompt_tokens"], stats["new_tokens"]
    details = {}
    if stats.get("prediction_tokens") is not None:  # Predicted Outputs, counted as OpenAI does
        details = {"completion_tokens_details": {"accepted_prediction_tokens": stats["accepted_prediction_tokens"],
                                                 "rejected_prediction_tokens": stats["rejected_prediction_tokens"]}}
    if stats.get("cached_prompt_tokens"):  # prompt tokens an earlier request's prefill served, as OpenAI reports them
        details["prompt_tokens_details"] = {"cached_tokens": stats["cached_prompt_tokens"]}
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        **details,
        "speculative": {
            "method": method,
            "num_draft_tokens": "auto" if num_draft_tokens is None else num_draft_tokens,
            "drafts": stats["drafts"],
            "drafted_tokens": stats["drafted_tokens"],
            "accepted_tokens": stats["accepted_tokens"],
            "acceptance_rate": stats["acceptance_rate"],
            "mean_accepted_length": stats["mean_accepted_length"],
            "acceptance_per_position": stats["acceptance_per_position"],
            "nodes_per_step": stats["nodes_per_step"],
            "accepted_path_length": stats["accepted_path_length"],
            "tree_steps": stats["tree_steps"],
            "by_drafter": stats["by_drafter"],
            "ttft_s": stats["ttft_s"],
            "tokens_per_s": stats["tokens_per_s"],
        },
    }


def timings(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """llama-server's `timings`, its names and meanings, so clients that benchmark it read ours unchanged: the
    prompt's `prompt_n` tokens computed (`cache_n` more came from the prompt cache) in `prompt_ms`, from the start
    of prefill to the first token; `predicted_n` tokens (the first included) in `predicted_ms`, from the first
    token to the last; `draft_n` / `draft_n_accepted` when anything was drafted. A rate over no time is None (null,
    as llama-server's JSON writes infinity). `choices`: GenerationStats.to_dict() of each; they share one prefill."""
    first = choices[0]
    cached = first.get("cached_prompt_tokens", 0)
    prompt_n, prompt_ms = first["prompt_tokens"] - cached, first["ttft_s"] * 1e3
    predicted_n = sum(c["new_tokens"] for c in choices)
    predicted_ms = max(c["wall_s"] - c["ttft_s"] for c in choices) * 1e3
    out = {"cache_n": cached,
           "prompt_n": prompt_n, "prompt_ms": prompt_ms, "prompt_per_token_ms": _per(prompt_ms, prompt_n),
           "prompt_per_second": _per(prompt_n * 1e3, prompt_ms),
           "predicted_n": predicted_n, "predicted_ms": predicted_ms,
           "predicted_per_token_ms": _per(predicted_ms, predicted_n),
           "predicted_per_second": _per(predicted_n * 1e3, predicted_ms)}
    drafted = sum(c["drafted_tokens"] for c in choices)
    if drafted:
        out |= {"draft_n": drafted, "draft_n_accepted": sum(c["accepted_tokens"] for c in choices)}
    return out


def _per(amount: float, over: float) -> float | None:
    return amount / over if over > 0 else None


def merged(choices: list[dict[str, Any]]) -> dict[str, Any]:
    """Several choices' statistics as one request's: counts add up, rates are recomputed."""
    out = dict(choices[0])
    for key in ("new_tokens", "drafts", "drafted_tokens", "accepted_tokens"):
        out[key] = sum(c[key] for c in choices)
    out["acceptance_rate"] = out["accepted_tokens"] / out["drafted_tokens"] if out["drafted_tokens"] else 0.0
    return out


def live_stats(stats: dict[str, Any]) -> dict[str, Any]:
    """The running figures the playground shows, sent with every stream chunk."""
    keys = ("new_tokens", "drafted_tokens", "accepted_tokens", "acceptance_rate", "mean_accepted_length",
            "nodes_per_step", "tree_steps", "tokens_per_s", "by_drafter")
    return {k: stats[k] for k in keys}


def completion(meta: Meta, answer: Answer, choices: list[Finished], usage_: dict[str, Any]) -> dict[str, Any]:
    out = []
    for index, done in enumerate(choices):
        prompt = (answer.echo_ids, done.prompt_logprobs) if answer.echo is not None and done.prompt_logprobs else None
        logprobs = answer.logprobs(done.token_ids, done.logprobs, prompt)
        if meta.chat:
            message, reason = answer.message(done.text, done.finish_reason)
            out.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason})
        else:
            text = (answer.echo or "") + done.text
            out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": done.finish_reason})
    return {"id": meta.id, "object": "chat.completion" if meta.chat else "text_completion",
            "created": meta.created, "model": meta.model, "choices": out, "usage": usage_,
            "timings": timings([done.stats for done in choices])}


def chunk(meta: Meta, text: str, finish_reason: str | None = None, role: bool = False,
          extension: dict[str, Any] | None = None, index: int = 0, logprobs: dict[str, Any] | None = None,
          tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    if meta.chat:
        delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    out = _chunk_head(meta) | {"choices": [choice]}
    if extension is not None:
        out["specdecode"] = extension
    return out


def usage_chunk(meta: Meta, usage_: dict[str, Any]) -> dict[str, Any]:
    """The extra last chunk of stream_options.include_usage: no choices, only usage."""
    return _chunk_head(meta) | {"choices": [], "usage": usage_}


def _chunk_head(meta: Meta) -> dict[str, Any]:
    return {"id": meta.id, "object": "chat.completion.chunk" if meta.chat else "text_completion",
            "created": meta.created, "model": meta.model}


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
