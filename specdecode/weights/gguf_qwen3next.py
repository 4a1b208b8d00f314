"""Qwen3-Next GGUF files (llama.cpp's `qwen3next` architecture), which transformers' GGUF reader refuses.

The config comes from the file's own metadata (`config_fields`), the tokenizer from transformers' GGUF tokenizer
builder called directly (`tokenizer`), and the tensors under llama.cpp's names map to Hugging Face's (`NAMES`), with
what llama.cpp's converter changed undone (`finish`):
- a gated DeltaNet layer's input projection was split into `attn_qkv` (every key head's q, then every k, then every
  v) and `attn_gate` (z); Hugging Face's `in_proj_qkvz` interleaves q, k, v and z per key head: the rows are
  gathered back, blocks and all (nothing is re-rounded);
- `ssm_a` holds -exp(A_log): A_log = log(-ssm_a) (the layer computes -exp(A_log) again, to the last bit or one);
- the convolution's weight lost its middle axis of 1;
- the shared expert's gate is a vector.
Norm weights hold 1 + w as written (but the DeltaNet output norm's, applied as is): loading.py runs every GGUF's
norms as plain multipliers. Every layer has experts (llama.cpp has no dense layer for this architecture). The MTP
block the converter keeps after the others (`nextn_predict_layers`: the layer under the next block number, its
fc and norms as `nextn.*`) is kept under the HF checkpoint's `mtp.*` names, for `--method mtp`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from specdecode.weights.blocks import PackedWeight

ARCHITECTURE = "qwen3next"

NAMES = [
    (r"blk\.(\d+)\.post_attention_norm\.(\w+)", r"model.layers.\1.post_attention_layernorm.\2"),
    (r"blk\.(\d+)\.attn_qkv\.weight", r"model.layers.\1.linear_attn.in_proj_qkv.weight"),  # merged by finish
    (r"blk\.(\d+)\.attn_gate\.weight", r"model.layers.\1.linear_attn.in_proj_z.weight"),  # merged by finish
    (r"blk\.(\d+)\.ssm_ba\.weight", r"model.layers.\1.linear_attn.in_proj_ba.weight"),
    (r"blk\.(\d+)\.ssm_conv1d\.weight", r"model.layers.\1.linear_attn.conv1d.weight"),
    (r"blk\.(\d+)\.ssm_dt\.bias", r"model.layers.\1.linear_attn.dt_bias"),
    (r"blk\.(\d+)\.ssm_a", r"model.layers.\1.linear_attn.A_log"),
    (r"blk\.(\d+)\.ssm_norm\.weight", r"model.layers.\1.linear_attn.norm.weight"),
    (r"blk\.(\d+)\.ssm_out\.weight", r"model.layers.\1.linear_attn.out_proj.weight"),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", r"model.layers.\1.mlp.shared_expert_gate.weight"),
    (r"blk\.(\d+)\.ffn_gate_shexp\.weight", r"model.layers.\1.mlp.shared_expert.gate_proj.weight"),
    (r"blk\.(\d+)\.ffn_up_shexp\.weight", r"model.layers.\1.mlp.shared_expert.up_proj.weight"),
    (r"blk\.(\d+)\.ffn_down_shexp\.weight", r"model.layers.\1.mlp.shared_expert.down_proj.weight"),
    # the MTP block's own (after the trunk's blocks; `finish` moves them under mtp.)
    (r"blk\.(\d+)\.nextn\.(eh_proj|enorm|hnorm|shared_head_norm)\.weight", r"model.layers.\1.nextn.\2.weight"),
]
# the MTP block's nextn tensors -> the Hugging Face checkpoint's mtp.* names (drafters/mtp.py reads those)
NEXTN_NAMES = {"eh_proj": "fc", "enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
               "shared_head_norm": "norm"}


def config_fields(reader: Any) -> dict[str, Any]:
    """The Hugging Face config (Qwen3NextConfig's fields) a qwen3next file's metadata describes."""
    fields = reader.fields

    def value(name: str, default: Any = None) -> Any:
        field = fields.get(f"{ARCHITECTURE}.{name}") if not name.startswith("tokenizer.") else fields.get(name)
        return field.contents() if field is not None else default

    blocks = int(value("block_count"))
    layers = blocks - int(value("nextn_predict_layers", 0))  # the MTP block comes after the others
    head_dim = int(value("attention.key_length"))
    interval = int(value("full_attention_interval", 4))
    recurrent = value("attention.recurrent_layers")
    if recurrent is None:
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    value_heads, inner = int(value("ssm.time_step_rank")), int(value("ssm.inner_size"))
    names = {t.name for t in reader.tensors}
    rotary = int(value("rope.dimension_count", head_dim))
    config = {
        "model_type": "qwen3_next",
        "architectures": ["Qwen3NextForCausalLM"],
        "vocab_size": len(value("tokenizer.ggml.tokens")),
        "hidden_size": int(value("embedding_length")),
        "num_hidden_layers": layers,
        "intermediate_size": int(value("feed_forward_length", 0)) or int(value("expert_feed_forward_length")),
        "num_attention_heads": int(value("attention.head_count")),
        "num_key_value_heads": int(value("attention.head_count_kv")),
        "head_dim": head_dim,
        "max_position_embeddings": int(value("context_length", 4096)),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(value("rope.freq_base", 10000.0)),
                            "partial_rotary_factor": rotary / head_dim},
        "num_experts": int(value("expert_count")),
        "num_experts_per_tok": int(value("expert_used_count")),
        "moe_intermediate_size": int(value("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(value("expert_shared_feed_forward_length", 0)),
        "norm_topk_prob": True,  # llama.cpp normalises the chosen experts' weights for this architecture
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "linear_conv_kernel_dim": int(value("ssm.conv_kernel")),
        "linear_key_head_dim": int(value("ssm.state_size")),
        "linear_num_key_heads": int(value("ssm.group_count")),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "layer_types": ["linear_attention" if r else "full_attention" for r in list(recurrent)[:layers]],
        "tie_word_embeddings": "output.weight" not in names,
    }
    for key in ("bos", "eos", "padding"):
        if (token := value(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{'pad' if key == 'padding' else key}_token_id"] = int(token)
    return config


def tokenizer(gguf: Path):
    """The file's tokenizer, from transformers' own GGUF tokenizer builder (its loader refuses the architecture
    before it gets there)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    architecture, tokens, special = get_gguf_tokenizer(str(gguf))
    backend, extra = convert_gguf_tokenizer(architecture, tokens)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special, **extra)


def finish(config: Any, blocks: dict[str, PackedWeight], floats: dict[str, Tensor]) -> None:
    """Undo the converter's changes (module docstring), in place; the MTP block (after the trunk's) under the
    checkpoint's `mtp.*` names, which the model ignores and the MTP drafter reads."""
    layers = config.num_hidden_layers
    for name in [n for n in (*blocks, *floats) if n.startswith("model.layers.")]:
        if (index := int(name.split(".")[2])) >= layers:
            rest = name.split(".", 3)[3]
            if rest.startswith("nextn."):
                kind = rest.split(".")[1]
                moved = f"mtp.{NEXTN_NAMES[kind]}.weight" if index == layers else None
            else:
                moved = f"mtp.layers.{index - layers}.{rest}"
            for table in (blocks, floats):
                if name in table:
                    value = table.pop(name)
                    if moved is not None:
                        table[moved] = value
    order = qkvz_rows(config)
    for i, kind in enumerate(config.layer_types):
        if kind != "linear_attention":
            continue
        at = f"model.layers.{i}.linear_attn."
        qkv, z = at + "in_proj_qkv.weight", at + "in_proj_z.weight"
        if qkv in blocks and z in blocks and blocks[qkv].format == blocks[z].format:
            blocks[at + "in_proj_qkvz.weight"] = rows_of(blocks.pop(qkv), blocks.pop(z), order)
        elif qkv in blocks or qkv in floats:  # float parts, or parts in two block types: in float
            parts = [blocks.pop(n).dequantize() if n in blocks else floats.pop(n).float() for n in (qkv, z)]
            floats[at + "in_proj_qkvz.weight"] = torch.cat(parts).index_select(0, order)
        if (a := floats.pop(at + "A_log", None)) is not None:
            floats[at + "A_log"] = torch.log(-a.float())
        if (conv := floats.get(at + "conv1d.weight")) is not None and conv.dim() == 2:
            floats[at + "conv1d.weight"] = conv.float()[:, None, :]
    for gate in [n for n in floats if n.endswith("mlp.shared_expert_gate.weight")]:  # the MTP block's too
        if floats[gate].dim() == 1:
            floats[gate] = floats[gate].float()[None]


def qkvz_rows(config: Any) -> Tensor:
    """Rows of [attn_qkv; attn_gate] in `in_proj_qkvz`'s order: per key head its q, k, v and z rows."""
    heads, dk = config.linear_num_key_heads, config.linear_key_head_dim
    group = config.linear_num_value_heads // heads * config.linear_value_head_dim  # v (and z) rows a key head
    keys, values = heads * dk, heads * group
    rows = []
    for h in range(heads):
        rows += range(h * dk, (h + 1) * dk)  # q
        rows += range(keys + h * dk, keys + (h + 1) * dk)  # k
        rows += range(2 * keys + h * group, 2 * keys + (h + 1) * group)  # v
        rows += range(2 * keys + values + h * group, 2 * keys + values + (h + 1) * group)  # z, after all of qkv
    return torch.tensor(rows)


def rows_of(first: PackedWeight, second: PackedWeight, order: Tensor) -> PackedWeight:
    """The rows `order` of two weights in one block type stacked, still packed."""
    stacked = [torch.cat((a, b)) if a.numel() else a for a, b in zip(first.tensors(), second.tensors())]
    return PackedWeight(first.format, *stacked).rows(order)
