"""A GGUF file with its quantized tensors as stored: the weights llama.cpp runs, at about the file's size.

The file's blocks are unpacked once into the integer kernel's layout (blocks.py: exact, nothing re-rounded) and
cached with the config and tokenizer as a folder `<cache>/converted/<stem>-<key>-as-stored/`, so later loads
read ~1 GB from disk and parse nothing. Norms and biases stay float32. Tensor names are mapped to Hugging Face's,
so the native model takes them like any checkpoint. Block types the kernel does not run (Q2_K, Q3_K, IQ*, ...)
are de-quantized to float32, with a warning naming the type. Gemma 3's norm weights stay as the file holds them,
1 + w (llama.cpp's converter adds the 1): loading.py runs them as plain multipliers, never adding it twice. A
mixture of experts' 3-D expert tensors become one matrix per expert (Qwen3-MoE, gpt-oss, Qwen3-Next; gpt-oss's
MXFP4 experts run on their own integer kernel). Qwen3-Next's DeltaNet tensors are put back as Hugging Face lays them
out (gguf_qwen3next.py).

A draft model's linear layers can be written again in fewer bits per weight at that step (`narrow`, e.g. 'q4_0':
blocks.narrowed): its guesses then read fewer bytes, and never change the output. Such a folder is cached apart.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from torch import Tensor
from tqdm import tqdm

from specdecode.errors import SpecdecodeError
from specdecode.weights import gguf_qwen3next, hub
from specdecode.weights.blocks import FORMATS, UNPACKED_TYPES, PackedWeight, from_gguf, narrowed, with_rows
from specdecode.weights.files import (
    conversion_prefix,
    gguf_config,
    gguf_tokenizer,
    guard_gguf,
    one_gguf_parse,
    read_config,  # fmt: skip
    read_tokenizer,
    same_vocabulary_files,
    write_folder,
)

log = logging.getLogger(__name__)

# GGUF tensor names -> Hugging Face parameter names, for the llama family.
NAMES = [
    (r"token_embd\.(\w+)", r"model.embed_tokens.\1"),
    (r"output_norm\.(\w+)", r"model.norm.\1"),
    (r"output\.(\w+)", r"lm_head.\1"),
    (r"blk\.(\d+)\.attn_norm\.(\w+)", r"model.layers.\1.input_layernorm.\2"),
    (r"blk\.(\d+)\.ffn_norm\.(\w+)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"blk\.(\d+)\.attn_q\.(\w+)", r"model.layers.\1.self_attn.q_proj.\2"),
    (r"blk\.(\d+)\.attn_k\.(\w+)", r"model.layers.\1.self_attn.k_proj.\2"),
    (r"blk\.(\d+)\.attn_v\.(\w+)", r"model.layers.\1.self_attn.v_proj.\2"),
    (r"blk\.(\d+)\.attn_output\.(\w+)", r"model.layers.\1.self_attn.o_proj.\2"),
    (r"blk\.(\d+)\.attn_q_norm\.(\w+)", r"model.layers.\1.self_attn.q_norm.\2"),
    (r"blk\.(\d+)\.attn_k_norm\.(\w+)", r"model.layers.\1.self_attn.k_norm.\2"),
    (r"blk\.(\d+)\.ffn_gate\.(\w+)", r"model.layers.\1.mlp.gate_proj.\2"),
    (r"blk\.(\d+)\.ffn_up\.(\w+)", r"model.layers.\1.mlp.up_proj.\2"),
    (r"blk\.(\d+)\.ffn_down\.(\w+)", r"model.layers.\1.mlp.down_proj.\2"),
]
# Gemma 3's four norms a layer: its ffn_norm is the MLP's pre-norm, and the attention and MLP outputs have their own
GEMMA3_NAMES = [
    (r"blk\.(\d+)\.post_attention_norm\.(\w+)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"blk\.(\d+)\.ffn_norm\.(\w+)", r"model.layers.\1.pre_feedforward_layernorm.\2"),
    (r"blk\.(\d+)\.post_ffw_norm\.(\w+)", r"model.layers.\1.post_feedforward_layernorm.\2"),
]
# Qwen3-MoE's router and experts: a 3-D tensor [experts, out, in] holds every expert's matrix, kept apart as
# `{expert}`'s own (expert_matrices), so a forward reads only the experts it routes to
QWEN3MOE_NAMES = [
    (r"blk\.(\d+)\.ffn_gate_inp\.(\w+)", r"model.layers.\1.mlp.gate.\2"),
    (r"blk\.(\d+)\.ffn_gate_exps\.(\w+)", r"model.layers.\1.mlp.experts.{expert}.gate_proj.\2"),
    (r"blk\.(\d+)\.ffn_up_exps\.(\w+)", r"model.layers.\1.mlp.experts.{expert}.up_proj.\2"),
    (r"blk\.(\d+)\.ffn_down_exps\.(\w+)", r"model.layers.\1.mlp.experts.{expert}.down_proj.\2"),
]
# gpt-oss's: the MLP's input norm under Gemma's name, a sink logit per head, and Qwen3-MoE's experts, biases beside
GPT_OSS_NAMES = [
    (r"blk\.(\d+)\.post_attention_norm\.(\w+)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"blk\.(\d+)\.attn_sinks\.weight", r"model.layers.\1.self_attn.sinks"),
    *QWEN3MOE_NAMES,
]
# by transformers' model type, tried before NAMES
FAMILY_NAMES = {"gemma3_text": GEMMA3_NAMES, "qwen3_moe": QWEN3MOE_NAMES, "gpt_oss": GPT_OSS_NAMES,
                "qwen3_next": [*gguf_qwen3next.NAMES, *QWEN3MOE_NAMES]}
# by model type: a family's tensors after the names are mapped, as its model reads them (the converter's changes
# undone)
FAMILY_FINISH = {"qwen3_next": gguf_qwen3next.finish}
FLOAT_TYPES = {"F32", "F16", "BF16"}
PACKED_FIELDS = ("qs", "qh", "scales", "mins", "d", "dmin")
# of blocks.PackedWeight and the float matrices (4: F16 and BF16 ones kept in 16 bits; 5: MXFP4's own blocks);
# part of the cache folder's name, so a new layout never reads an old folder
LAYOUT = 5


@dataclass
class StoredCheckpoint:
    config: dict[str, Any]  # as weights.read_config returns it
    floats: dict[str, Tensor]  # HF names -> float32 tensors (norms, biases, float or de-quantized weights)
    packed: dict[str, PackedWeight]  # HF names -> weights in blocks
    tokenizer: Any


def stored_dir(gguf: Path, cache: Path | None = None, narrow: str = "none") -> Path:
    form = "as-stored" if narrow == "none" else f"narrowed-{narrow}"
    return (cache or hub.cache_dir()) / "converted" / f"{conversion_prefix(gguf)}{form}-v{LAYOUT}"


def load_stored(gguf: Path, cache: Path | None = None, tokenizer_like: Any = None,
                narrow: str = "none") -> StoredCheckpoint:
    """The GGUF file's weights as stored (unpacked and cached on first use). `tokenizer_like`: a tokenizer already
    loaded (the target's, for its draft), which is this file's too when its vocabulary files are the same bytes:
    reading a second copy costs ~1.5 s of a start. `narrow`: a block type for the linear layers stored in more bits
    per weight ('none': every block as stored)."""
    folder = stored_dir(gguf, cache, narrow)
    if not folder.is_dir():
        unpack_gguf(gguf, folder, narrow)
    floats: dict[str, Tensor] = {}
    fields: dict[str, dict[str, Tensor]] = {}
    with safe_open(folder / "model.safetensors", "pt") as file:
        formats = json.loads(file.metadata()["block_formats"])
        for key in file.keys():
            # Copied out of the file's mapping: a mapped tensor is read lazily (page faults on the first forward)
            # and keeps the whole mapping resident beside the kernels' repacked copies.
            value = file.get_tensor(key).clone()
            name, _, field = key.rpartition(":")
            if name in formats:
                fields.setdefault(name, {})[field] = value
            else:
                floats[key] = value
    packed = {name: PackedWeight(FORMATS[fmt], *(fields[name].get(f, torch.empty(0, dtype=torch.uint8))
                                                 for f in PACKED_FIELDS)) for name, fmt in formats.items()}
    where = getattr(tokenizer_like, "name_or_path", None)  # the folder it was read from
    if not where or not same_vocabulary_files(folder, Path(where)):
        tokenizer_like = read_tokenizer(folder)
    return StoredCheckpoint(read_config(folder), floats, packed, tokenizer_like)


def unpack_gguf(gguf: Path, out: Path, narrow: str = "none") -> None:
    """Read every tensor of `gguf`, unpack the blocks, map the names, and write the cache folder `out`."""
    with one_gguf_parse():
        _unpack_gguf(gguf, out, narrow)


def _unpack_gguf(gguf: Path, out: Path, narrow: str) -> None:
    import gguf as gguf_package  # its reader looked up at the call: shared within one_gguf_parse
    from gguf.quants import dequantize

    config, skeleton = gguf_config(gguf)
    reader = guard_gguf(gguf, lambda: gguf_package.GGUFReader(gguf))
    permute = _llama_permutation(config) if config.model_type in ("llama", "mistral") else {}
    tensors: dict[str, Tensor] = {}
    blocks: dict[str, PackedWeight] = {}
    warned: set[str] = set()
    for t in tqdm(reader.tensors, desc=f"unpack {gguf.name}", unit="tensor", leave=False):
        mapped = hf_name(t.name, config.model_type)
        if mapped is None:
            continue
        type_name = t.tensor_type.name
        full_shape = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF lists the fastest dimension first
        kind = mapped.rpartition(".")[0].rpartition(".")[2]  # e.g. q_proj
        for name, data, shape in expert_matrices(mapped, t.data, full_shape):
            packed = None
            if type_name.lower() in UNPACKED_TYPES and len(shape) == 2:
                packed = unpacked(gguf, type_name, data, shape, warned)
            if packed is not None:
                if kind in permute:
                    packed = with_rows(packed, permute[kind])
                if narrow != "none" and name != "model.embed_tokens.weight":  # the embedding (and a head tied to
                    packed = narrowed(packed, narrow)  # it) is looked up a row at a time: no reads per token
                blocks[name] = packed
                continue
            if type_name not in FLOAT_TYPES and type_name not in warned:
                warned.add(type_name)
                log.warning("specdecode: GGUF block type %s has no integer kernel; running it de-quantized",
                            type_name)
            value = float_tensor(data, type_name, shape) if type_name in FLOAT_TYPES else torch.from_numpy(
                np.array(dequantize(data, t.tensor_type), dtype=np.float32)).reshape(shape)
            tensors[name] = value[permute[kind]] if kind in permute else value
    if (finish := FAMILY_FINISH.get(config.model_type)) is not None:  # what its converter changed, undone
        finish(config, blocks, tensors)
    formats: dict[str, str] = {}
    for name, packed in blocks.items():
        formats[name] = packed.format.name
        for field in PACKED_FIELDS:
            if (value := getattr(packed, field)).numel():
                tensors[f"{name}:{field}"] = value
    expected = unfused_names(skeleton.state_dict()) - {"lm_head.weight"}
    if missing := sorted(expected - set(formats) - set(tensors)):
        raise SpecdecodeError(f"{gguf} lacks {len(missing)} tensors (first: {missing[0]}); the file is incomplete")
    if "lm_head.weight" not in formats and "lm_head.weight" not in tensors:
        config.tie_word_embeddings = True
    write_folder(out, config, tensors, gguf_tokenizer(gguf), {"block_formats": json.dumps(formats)})


def unpacked(gguf: Path, type_name: str, data: np.ndarray, shape: tuple[int, ...],
             warned: set[str]) -> PackedWeight | None:
    """One matrix's blocks in the kernels' layout; None where MXFP4's scales do not fit the Q5_0 form it runs
    as (that matrix then runs de-quantized, said once)."""
    if type_name == "MXFP4":
        try:
            return from_gguf(type_name, data, shape)
        except ValueError:
            if "MXFP4 scales" not in warned:
                warned.add("MXFP4 scales")
                log.warning("specdecode: an MXFP4 tensor's scales fall outside float16's range; running it "
                            "de-quantized")
            return None
    return guard_gguf(gguf, lambda: from_gguf(type_name, data, shape))


def float_tensor(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Tensor:
    """A GGUF float tensor as stored: F32 and F16 as numpy reads them, BF16 from its raw bytes (numpy has no
    bfloat16: the reader gives two bytes a value). Matrices keep their 16-bit dtype (the linear layers run it on the
    kernels, the embedding widens the rows it looks up); vectors (norms, biases) become float32."""
    raw = np.ascontiguousarray(data)
    if type_name == "BF16":
        value = torch.from_numpy(raw.view(np.uint8).copy()).view(torch.bfloat16).reshape(shape)
    else:
        value = torch.from_numpy(raw.copy()).reshape(shape)
    return value if value.dim() == 2 else value.float()


def expert_matrices(name: str, data: np.ndarray, shape: tuple[int, ...]
                    ) -> list[tuple[str, np.ndarray, tuple[int, ...]]]:
    """A tensor as the matrices it holds: itself, or where its name has `{expert}` (a 3-D expert tensor, data
    [experts, out, row bytes or in]) each expert's [out, in] under its own name."""
    if "{expert}" not in name:
        return [(name, data, shape)]
    return [(name.format(expert=e), data[e], shape[1:]) for e in range(shape[0])]


def unfused_names(state_dict: dict[str, Tensor]) -> set[str]:
    """A transformers model's parameter names with its fused expert tensors as one matrix per expert (the names
    a checkpoint on disk and the native model use)."""
    from specdecode.models.experts import split_fused_experts, split_interleaved_experts

    names = dict(state_dict)
    for prefix in {k.removesuffix("experts.gate_up_proj") for k in state_dict if k.endswith("experts.gate_up_proj")}:
        if f"{prefix}experts.gate_up_proj_bias" in names:  # gpt-oss's layout (and its router's name)
            split_interleaved_experts(names, prefix)
        else:
            split_fused_experts(None, names, prefix)
    return set(names)


def hf_name(gguf_name: str, model_type: str | None = None) -> str | None:
    for pattern, replacement in [*FAMILY_NAMES.get(model_type, []), *NAMES]:
        if re.fullmatch(pattern, gguf_name):
            return re.sub(pattern, replacement, gguf_name)
    return None  # e.g. rope_freqs: recomputed from the config


def _llama_permutation(config: Any) -> dict[str, Tensor]:
    """llama.cpp stores llama q/k rows reordered for its rotary layout; these row orders undo it."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    def order(heads: int) -> Tensor:
        return torch.arange(heads * head_dim).view(heads, head_dim // 2, 2).transpose(1, 2).reshape(-1)

    kv_heads = config.num_key_value_heads or config.num_attention_heads
    return {"q_proj": order(config.num_attention_heads), "k_proj": order(kv_heads)}
