"""gpt-oss GGUF files (llama.cpp's `gpt-oss` architecture) as transformers' GGUF reader cannot take them whole.

transformers (5.x) reads a gpt-oss file's `rope.scaling.*` fields from the wrong part of each field and fails, in its
config loader and its tokenizer loader alike; and it reads neither the head width nor the sliding window (its
config's defaults, 64 and 128, are the real model's, not the file's). While it parses, those rope fields are hidden
from the reader every parse of the file shares (files.one_gguf_parse), and the config is completed from the file's
own values afterwards. The clamped SwiGLU's limit and gain are not in a file (llama.cpp fixes them at the real
model's, 7 and 1.702, which are the config's defaults too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

ARCHITECTURE = "gpt-oss"
ROPE_SCALING = f"{ARCHITECTURE}.rope.scaling."


@contextmanager
def readable_by_transformers(reader: Any | None) -> Iterator[dict[str, Any]]:
    """Around a transformers call that parses a gpt-oss file, whose shared reader is `reader` (files.gpt_oss_reader;
    None: nothing to hide): its rope scaling fields hidden from the reader, and yielded as {name: value}."""
    if reader is None:
        yield {}
        return
    hidden = {key: reader.fields.pop(key) for key in list(reader.fields) if key.startswith(ROPE_SCALING)}
    try:
        yield {key.removeprefix(ROPE_SCALING): field.contents() for key, field in hidden.items()}
    finally:
        reader.fields.update(hidden)


def gpt_oss_config_fields(reader: Any, scaling: dict[str, Any]) -> dict[str, Any]:
    """The HF config fields transformers leaves out or gets wrong for a gpt-oss file (its `reader`): the head width,
    the sliding window, the experts' width, and the rope scaling (`scaling`, as readable_by_transformers yielded
    it)."""
    fields = reader.fields

    def value(name: str) -> Any:
        field = fields.get(f"{ARCHITECTURE}.{name}")
        return field.contents() if field is not None else None

    out: dict[str, Any] = {}
    if (head_dim := value("attention.key_length")) is not None:
        out["head_dim"] = int(head_dim)
    if (window := value("attention.sliding_window")) is not None:
        out["sliding_window"] = int(window)
    if (width := value("expert_feed_forward_length") or value("feed_forward_length")) is not None:
        out["intermediate_size"] = int(width)
    kind = scaling.get("type")
    if kind and kind != "none":
        rope = {"rope_type": kind, "factor": float(scaling.get("factor") or 1.0),
                # the published checkpoints' correction range, not rounded to whole dimensions
                "truncate": False}
        if (length := scaling.get("original_context_length")) is not None:
            rope["original_max_position_embeddings"] = int(length)
        for name in ("beta_fast", "beta_slow", "attention_factor"):  # llama.cpp's writer prefixes yarn_
            if (given := scaling.get(f"yarn_{name}", scaling.get(name))) is not None:
                rope[name] = float(given)
        out["rope_scaling"] = rope
    return out
