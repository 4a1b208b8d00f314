"""A draft model whose LM head scores only the most frequent tokens (FR-Spec, Zhao et al. 2025, arXiv:2502.14856).

A small draft model spends a large share of each step in its LM head: for Qwen2.5-0.5B the output matrix has
151,936 rows of 896, more weight bytes than any other layer. Most of those tokens are rare, so the draft keeps
only the ~32k most frequent rows. Speculation stays exact because the target verifies every draft token; under
sampling the draft distribution is the softmax over the subset (renormalised), and a token outside the subset
is never proposed (its draft probability is zero, which the rejection rule handles like any other zero).

Which tokens: counted on a corpus (`count_tokens` over `texts_from_jsonl`), or, with no corpus, by merge rank:
byte-level BPE vocabularies (Qwen, Llama 3, SmolLM2) number tokens in merge order, which follows frequency in
the tokenizer's training corpus, so the lowest ids are a good proxy (`by_merge_rank`). The subset is padded to a
multiple of 16 with the next most frequent ids, so a head in blocks keeps the 16-channel kernel
(quantize.QuantLinear takes it only when the row count is a multiple of 16).

`restrict_lm_head` swaps the head for one over the subset's rows, in the same form as before (float Linear,
KernelLinear or QuantLinear), applied from outside the model like quantization; logit j of the new head is the
logit of vocabulary id `token_ids[j]`, which the drafter is given (`DraftModelDrafter(head_tokens=...)`).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.weights import hub
from specdecode.weights.blocks import FORMATS, PackedWeight
from specdecode.weights.files import conversion_prefix, resolve_source
from specdecode.weights.gguf_stored import PACKED_FIELDS, stored_dir
from specdecode.weights.quantize import KernelLinear, QuantLinear

CHANNEL_MULTIPLE = 16  # rows per vector of quantize.QuantLinear's 16-channel kernel


def vocab_fingerprint(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id): packaged frequency lists apply only to it."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256("\n".join(f"{i} {t}" for t, i in items).encode()).hexdigest()[:16]


def shipped_rankings() -> list[Path]:
    """The frequency lists shipped in the package's resources/ folder."""
    return sorted(Path(str(files("specdecode").joinpath("resources"))).glob("frequent-tokens-*.npz"))


def packaged_ranking(tokenizer: Any) -> torch.Tensor | None:
    """Ids most frequent first, counted on instruction data and shipped with specdecode for this tokenizer's
    vocabulary (specdecode/resources/frequent-tokens-*.npz); None when none matches."""
    fingerprint = None
    for path in shipped_rankings():
        with np.load(path) as data:
            fingerprint = fingerprint or vocab_fingerprint(tokenizer)
            if str(data["fingerprint"]) == fingerprint:
                return torch.from_numpy(data["ids"].astype(np.int64))
    return None


def frequent_tokens(counts: torch.Tensor, size: int, always: Iterable[int] = (),
                    multiple: int = CHANNEL_MULTIPLE) -> torch.Tensor:
    """The ids of the `size` most frequent tokens (ties: lower id first) plus every id in `always`, padded with
    the next most frequent ids to a multiple of `multiple` -> sorted, unique int64 [n]."""
    # counts: [vocab] int; a stable descending sort keeps equal counts in id order
    ranked = torch.sort(counts.to(torch.int64), descending=True, stable=True).indices
    return _top(ranked, size, always, multiple)


def by_merge_rank(vocab_size: int, size: int, always: Iterable[int] = (),
                  multiple: int = CHANNEL_MULTIPLE) -> torch.Tensor:
    """The default with no corpus: the `size` lowest ids (earliest BPE merges), `always`, and padding, as in
    `frequent_tokens`."""
    return _top(torch.arange(vocab_size), size, always, multiple)


def _top(ranked: torch.Tensor, size: int, always: Iterable[int], multiple: int) -> torch.Tensor:
    # ranked: [vocab] ids, most frequent first
    vocab = ranked.numel()
    forced = torch.tensor([int(i) for i in always], dtype=torch.int64)
    if forced.numel() and (forced.min() < 0 or forced.max() >= vocab):
        raise ValueError(f"ids in `always` must lie in [0, {vocab})")
    chosen = torch.cat((ranked[:size], forced)).unique()  # [n] sorted
    rest = ranked[size:]
    rest = rest[~torch.isin(rest, chosen)]  # next most frequent, in rank order
    pad = -chosen.numel() % multiple
    return torch.cat((chosen, rest[:pad])).unique()


def count_tokens(tokenizer: Any, texts: Iterable[str], vocab_size: int, batch_size: int = 256,
                 progress: bool = True) -> torch.Tensor:
    """How often each id occurs when `texts` are tokenized (no special tokens added) -> [vocab_size] int64.
    Texts go to the tokenizer in batches: a fast tokenizer encodes a batch in parallel."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    batch: list[str] = []

    def flush() -> None:
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"]  # list of lists
        flat = np.fromiter((i for row in ids for i in row), dtype=np.int64)
        if flat.size and flat.max() >= vocab_size:
            raise ValueError(f"the tokenizer produced id {flat.max()}, outside the model's vocabulary {vocab_size}")
        counts[:] += np.bincount(flat, minlength=vocab_size)
        batch.clear()

    for text in tqdm(texts, desc="count tokens", unit="text", disable=not progress):
        batch.append(text)
        if len(batch) == batch_size:
            flush()
    if batch:
        flush()
    return torch.from_numpy(counts)


def texts_from_jsonl(paths: Iterable[str | Path], limit: int | None = None) -> Iterator[str]:
    """Every string in each record of the jsonl files (nested lists and dicts walked generically, so
    instruction/input/output and chat `messages` shapes alike), for at most `limit` records in all."""
    records = 0
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for line in file:
                if limit is not None and records >= limit:
                    return
                if line.strip():
                    records += 1
                    yield from _strings(json.loads(line))


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def subset_path(model_file_or_dir: Path, size: int, corpus_key: str, cache: Path | None = None) -> Path:
    """Where a subset is cached: beside the model's converted weights, keyed like them by the model file's size
    and mtime (`weights.conversion_prefix`), so a replaced model file never reads an old subset."""
    key = re.sub(r"[^A-Za-z0-9_.-]+", "-", corpus_key)
    name = f"{conversion_prefix(Path(model_file_or_dir))}head-subset-{size}-{key}.pt"
    return (cache or hub.cache_dir()) / "converted" / name


def load_or_build(path: Path, build: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The id list saved at `path` (.pt or .npy), or `build()`'s, saved there first -> int64 [n]."""
    if path.is_file():
        ids = np.load(path) if path.suffix == ".npy" else torch.load(path, weights_only=True)
        return torch.as_tensor(ids, dtype=torch.int64)
    ids = build().to(torch.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # written whole, then renamed: no torn files
    with open(tmp, "wb") as file:
        if path.suffix == ".npy":
            np.save(file, ids.numpy())
        else:
            torch.save(ids, file)
    os.replace(tmp, path)
    return ids


def stored_head(gguf: Path, cache: Path | None = None, narrow: str = "none") -> PackedWeight | None:
    """The output matrix of a GGUF model as stored (row layout), read from its unpacked cache folder (the one for
    `narrow`, as the model was loaded): for a head whose rows were dropped at load (QuantLinear repacked to 16
    channels). None when the head is not in blocks."""
    folder = stored_dir(Path(gguf), cache, narrow)
    with safe_open(folder / "model.safetensors", "pt") as file:
        formats = json.loads(file.metadata()["block_formats"])
        keys = set(file.keys())
        if "lm_head.weight" in formats:
            name = "lm_head.weight"
        elif "lm_head.weight" not in keys and "model.embed_tokens.weight" in formats:
            name = "model.embed_tokens.weight"  # tied: the output matrix is the embedding's blocks
        else:
            return None
        fields = [file.get_tensor(f"{name}:{f}") if f"{name}:{f}" in keys else torch.empty(0, dtype=torch.uint8)
                  for f in PACKED_FIELDS]
    return PackedWeight(FORMATS[formats[name]], *fields)


def restrict_lm_head(model: nn.Module, token_ids: torch.Tensor, stored: PackedWeight | None = None) -> torch.Tensor:
    """Replace `model.lm_head` by one computing the logits of `token_ids` only ([..., n]) -> `token_ids`, the
    vocabulary id of each new logit. In place; the embedding is untouched (a tied head's rows are copied). A
    QuantLinear head that dropped its row layout needs `stored` (`stored_head`)."""
    if _head_rows(model.lm_head) != model.config.vocab_size:
        raise SpecdecodeError("the LM head is already restricted to a subset; restrict the full head once")
    ids = torch.as_tensor(token_ids, dtype=torch.int64).cpu()  # [n]
    if ids.unique().numel() != ids.numel():
        raise ValueError("token_ids must be unique")
    model.lm_head = _sliced(model.lm_head, ids, stored)
    return ids.to(model.device)


def _head_rows(head: nn.Module) -> int:
    return head.out_features if isinstance(head, QuantLinear) else head.weight.shape[0]


def _sliced(head: nn.Module, ids: torch.Tensor, stored: PackedWeight | None) -> nn.Module:
    if isinstance(head, QuantLinear):
        packed = head.packed if head.packed is not None else stored
        if packed is None:
            raise SpecdecodeError("this LM head was repacked for the 16-channel kernel and kept no rows; pass "
                                  "stored=stored_head(gguf) to restrict it")
        _check_ids(ids, packed.shape[0])
        bias = head.bias[ids] if head.bias is not None else None
        # Rows are output channels in every field (qs, qh, scales, mins, d, dmin): slice them before any repack,
        # then build the layer as the loader does; its own rows are not kept (no embedding looks them up).
        return QuantLinear(packed.rows(ids), bias, cpu_kernels())
    if isinstance(head, KernelLinear):
        return KernelLinear(_linear_rows(head.weight, head.bias, ids), cpu_kernels())
    if isinstance(head, nn.Linear):
        return _linear_rows(head.weight, head.bias, ids)
    raise SpecdecodeError(f"cannot restrict an LM head of type {type(head).__name__}")


def _linear_rows(weight: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor) -> nn.Linear:
    # weight: [vocab, d]; the rows are copied, so a tied embedding keeps its own full matrix
    _check_ids(ids, weight.shape[0])
    ids = ids.to(weight.device)
    linear = nn.Linear(weight.shape[1], ids.numel(), bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach()[ids].clone(), requires_grad=weight.requires_grad)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach()[ids].clone(), requires_grad=bias.requires_grad)
    return linear


def _check_ids(ids: torch.Tensor, vocab: int) -> None:
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab):
        raise ValueError(f"token ids must lie in [0, {vocab})")


DEFAULT_HEAD_SIZE = 32768  # FR-Spec's speed peak; a multiple of 16


def cut_draft_head(model: nn.Module, tokenizer: Any, source: str, size: int = DEFAULT_HEAD_SIZE,
                   corpus: list[str] | None = None, narrow: str = "none") -> torch.Tensor | None:
    """Restrict a loaded draft model's LM head to the `size` most frequent tokens of its tokenizer, counted on
    `corpus` (jsonl files; counts cached beside the converted weights) or, without one, on the instruction data
    shipped for this vocabulary. -> the vocabulary id of each logit of the cut head, or None where it stays whole:
    when `size` is 0 or covers the vocabulary, or when no frequency list matches the tokenizer (ranking by id alone
    loses more acceptance than it saves). `narrow`: the block type a GGUF model's layers were narrowed to at load."""
    from specdecode.models.model import Transformer

    vocab = model.config.vocab_size
    if size <= 0 or size >= vocab or not isinstance(model, Transformer):  # transformers' models keep their head
        return None
    if corpus:
        stamp = ",".join(f"{Path(p).name}:{Path(p).stat().st_size}:{int(Path(p).stat().st_mtime)}" for p in corpus)
        key = hashlib.sha256(stamp.encode()).hexdigest()[:12]
        path = subset_path(Path(resolve_source(source)), vocab, f"counts-{key}")
        counts = load_or_build(path, lambda: count_tokens(tokenizer, texts_from_jsonl(corpus), vocab))
        ranking = torch.sort(counts, descending=True, stable=True).indices
    else:
        ranking = packaged_ranking(tokenizer)
        if ranking is None:
            return None
    ranking = ranking[ranking < vocab]
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[ranking] = False
    ranking = torch.cat((ranking, rest.nonzero().squeeze(-1)))  # ids never counted follow, lowest (earliest merge) first
    always = {*tokenizer.all_special_ids, *model.config.eos_token_ids}
    ids = _top(ranking, size, [i for i in always if 0 <= i < vocab], CHANNEL_MULTIPLE)
    head = model.lm_head
    stored = None
    if isinstance(head, QuantLinear) and head.packed is None:
        stored = stored_head(Path(resolve_source(source)), narrow=narrow)
    return restrict_lm_head(model, ids, stored)

