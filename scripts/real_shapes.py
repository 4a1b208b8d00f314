"""A few layers of a real mixture-of-experts configuration, random weights in blocks, as a GGUF file; then the time
of a forward over M rows (decode M = 1, verify M = 2..16) on the native model as stored and on llama.cpp on the
same file, and the cost curve the planner measures for it.

    python scripts/real_shapes.py --shape qwen3-30b-a3b --layers 4 --blocks Q4_0 --sizes 1,2,4,8,16

Shapes: `qwen3-30b-a3b` (Qwen3-30B-A3B's layer: 2048 wide, 128 experts of 768, 8 a token, 32 query and 4 KV heads of
128), `gpt-oss-20b` (2880 wide, 32 experts of 2880, 4 a token, 64 query and 8 KV heads of 64, sinks, a window of 128
on every other layer) and `qwen3-next-80b-a3b` (2048 wide, 512 experts of 512, 10 a token, and a shared one; three
gated DeltaNet layers in four, 16 key and 32 value heads of 128, then gated attention, 16 query and 2 KV heads of
256, a quarter rotating: `--layers 4` is one of each pattern). The vocabulary is 1,024 made-up tokens, so the head and the embedding cost next to nothing and
a forward's time is its layers'. The blocks' codes are random bytes under one small scale (no float weights are ever
made: a real layer is 0.6-0.8 billion weights), the router in float32 as llama.cpp's quantizer keeps it. Rows are
distinct random tokens, so they route to many experts, as a verify forward's rows do (an upper bound on the union).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))

VOCAB = 1024
BLOCK_BYTES = {"Q4_0": 18, "Q8_0": 34, "MXFP4": 17}  # per 32 weights: a float16 scale (MXFP4: an exponent byte),
# then the codes


@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    used: int
    expert_width: int
    rope_theta: float
    window: int = 0  # gpt-oss: the sliding window of every other layer
    shared_width: int = 0  # Qwen3-Next: the shared expert's width, and its gated DeltaNet layers (3 in 4):
    linear_heads: tuple[int, int] = (0, 0)  # key and value heads
    linear_dim: int = 0  # of a key (and value) head
    rotary: int = 0  # rotated dimensions of a full-attention head (0: all)


SHAPES = {
    "qwen3-30b-a3b": Shape("qwen3moe", 2048, 32, 4, 128, 128, 8, 768, 1e6),
    "gpt-oss-20b": Shape("gpt-oss", 2880, 64, 8, 64, 32, 4, 2880, 150000.0, window=128),
    "qwen3-next-80b-a3b": Shape("qwen3next", 2048, 16, 2, 256, 512, 10, 512, 1e7, shared_width=512,
                                linear_heads=(16, 32), linear_dim=128, rotary=64),
}


def blocks(rng: np.random.Generator, kind: str, *shape: int) -> np.ndarray:
    """Random codes in `kind`'s blocks for a float tensor of `shape` (the last dimension the input one): bytes
    [..., in / 32 * block bytes], each block's scale the float16 0.004 (Q4_0) or 0.0005 (Q8_0), or 2^-8 (MXFP4),
    outputs of about unit scale for inputs of unit scale."""
    *outer, inner = shape
    size = BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, size=(*outer, inner // 32, size), dtype=np.uint8)
    if kind == "MXFP4":
        raw[..., 0] = 119
        return raw.reshape(*outer, inner // 32 * size)
    scale = np.array([0.004 if kind == "Q4_0" else 0.0005], np.float16).view(np.uint8)
    raw[..., 0], raw[..., 1] = scale[0], scale[1]
    return raw.reshape(*outer, inner // 32 * size)


def write(path: Path, shape: Shape, layers: int, kind: str, expert_kind: str | None = None, seed: int = 0) -> None:
    import gguf
    from tqdm import tqdm

    rng = np.random.default_rng(seed)
    s = shape
    writer = gguf.GGUFWriter(str(path), s.arch)
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(s.hidden)
    writer.add_feed_forward_length(s.expert_width)
    writer.add_expert_feed_forward_length(s.expert_width)
    writer.add_expert_count(s.experts)
    writer.add_expert_used_count(s.used)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_key_length(s.head_dim)
    writer.add_value_length(s.head_dim)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    if s.arch == "qwen3next":
        writer.add_expert_shared_feed_forward_length(s.shared_width)
        writer.add_rope_dimension_count(s.rotary)
        writer.add_ssm_conv_kernel(4)
        writer.add_ssm_state_size(s.linear_dim)
        writer.add_ssm_group_count(s.linear_heads[0])
        writer.add_ssm_time_step_rank(s.linear_heads[1])
        writer.add_ssm_inner_size(s.linear_heads[1] * s.linear_dim)
        writer.add_full_attention_interval(4)
    if s.window:
        writer.add_sliding_window(s.window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
    tokens = ["<pad>", "</s>", "<s>", "<unk>"] + [f"t{i}" for i in range(VOCAB - 4)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([3, 3, 3, 2] + [1] * (VOCAB - 4))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)

    def matrix(name: str, *dims: int) -> None:
        chosen = expert_kind if expert_kind and "_exps" in name else kind
        writer.add_tensor(name, blocks(rng, chosen, *dims), raw_dtype=gguf.GGMLQuantizationType[chosen])

    def floats(name: str, *dims: int, scale: float = 1.0, ones: bool = False) -> None:
        values = np.ones(dims, np.float32) if ones else (rng.standard_normal(dims) * scale).astype(np.float32)
        writer.add_tensor(name, values)

    d, q, kv = s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim
    matrix("token_embd.weight", VOCAB, d)
    floats("output_norm.weight", d, ones=True)
    matrix("output.weight", VOCAB, d)
    for i in tqdm(range(layers), desc=f"write {path.name}", unit="layer"):
        b = f"blk.{i}."
        floats(b + "attn_norm.weight", d, ones=True)
        if s.arch == "qwen3next" and (i + 1) % 4:  # a gated DeltaNet layer
            keys, values = s.linear_heads[0] * s.linear_dim, s.linear_heads[1] * s.linear_dim
            matrix(b + "attn_qkv.weight", 2 * keys + values, d)
            matrix(b + "attn_gate.weight", values, d)
            matrix(b + "ssm_ba.weight", 2 * s.linear_heads[1], d)
            floats(b + "ssm_conv1d.weight", 2 * keys + values, 4, scale=0.3)
            floats(b + "ssm_dt.bias", s.linear_heads[1], scale=0.1)
            writer.add_tensor(b + "ssm_a", -rng.uniform(0.1, 1.0, s.linear_heads[1]).astype(np.float32))
            floats(b + "ssm_norm.weight", s.linear_dim, ones=True)
            matrix(b + "ssm_out.weight", d, values)
        else:
            matrix(b + "attn_q.weight", 2 * q if s.arch == "qwen3next" else q, d)  # Qwen3-Next: a gate per query
            matrix(b + "attn_k.weight", kv, d)
            matrix(b + "attn_v.weight", kv, d)
            matrix(b + "attn_output.weight", d, q)
        if s.arch == "qwen3next":
            floats(b + "post_attention_norm.weight", d, ones=True)
            if (i + 1) % 4 == 0:
                floats(b + "attn_q_norm.weight", s.head_dim, ones=True)
                floats(b + "attn_k_norm.weight", s.head_dim, ones=True)
            floats(b + "ffn_gate_inp_shexp.weight", d, scale=0.02)
            matrix(b + "ffn_gate_shexp.weight", s.shared_width, d)
            matrix(b + "ffn_up_shexp.weight", s.shared_width, d)
            matrix(b + "ffn_down_shexp.weight", d, s.shared_width)
        floats(b + "ffn_gate_inp.weight", s.experts, d, scale=0.02)
        matrix(b + "ffn_gate_exps.weight", s.experts, s.expert_width, d)
        matrix(b + "ffn_up_exps.weight", s.experts, s.expert_width, d)
        matrix(b + "ffn_down_exps.weight", s.experts, d, s.expert_width)
        if s.arch == "qwen3moe":
            floats(b + "attn_q_norm.weight", s.head_dim, ones=True)
            floats(b + "attn_k_norm.weight", s.head_dim, ones=True)
            floats(b + "ffn_norm.weight", d, ones=True)
        elif s.arch == "gpt-oss":  # biases everywhere, sinks, the norm before the experts under its own name
            floats(b + "post_attention_norm.weight", d, ones=True)
            floats(b + "attn_sinks.weight", s.heads, scale=0.5)
            floats(b + "ffn_gate_inp.bias", s.experts, scale=0.02)
            for name, width in (("attn_q", q), ("attn_k", kv), ("attn_v", kv), ("attn_output", d)):
                floats(f"{b}{name}.bias", width, scale=0.01)
            for name, width in (("ffn_gate_exps", s.expert_width), ("ffn_up_exps", s.expert_width),
                                ("ffn_down_exps", d)):
                floats(f"{b}{name}.bias", s.experts, width, scale=0.01)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def main() -> None:
    from verify_cost import forward_ms, llamacpp_row, parse_sizes

    from specdecode.models.masks import chain_mask
    from specdecode.planner.budget import measure
    from specdecode.weights.loading import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--blocks", choices=["Q4_0", "Q8_0"], default="Q4_0")
    ap.add_argument("--expert-blocks", choices=sorted(BLOCK_BYTES), default=None,
                    help="the experts' own block type (default --blocks'; gpt-oss ships MXFP4 experts)")
    ap.add_argument("--sizes", default="1,2,4,8,16", help="M values: '1,2,4,8' or a range '1-16'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="ours and llama.cpp in turns, each keeping its best")
    ap.add_argument("--out", type=Path, default=None, help="the GGUF file (default: one in /tmp per shape)")
    ap.add_argument("--curve", action="store_true", help="also the planner's cost curve (budget.measure)")
    args = ap.parse_args()
    shape = SHAPES[args.shape]
    experts = args.expert_blocks or args.blocks
    path = args.out or Path(f"/tmp/{args.shape}-{args.layers}l-{args.blocks.lower()}-{experts.lower()}.gguf")
    if not path.exists():
        write(path, shape, args.layers, args.blocks, experts)
    sizes = parse_sizes(args.sizes)
    started = time.perf_counter()
    model, _ = load_model(str(path), torch.float32, weights="stored")
    print(f"loaded as stored in {time.perf_counter() - started:.0f} s (the first load unpacks the file once)")
    cache = model.new_cache(1, 512)
    with torch.inference_mode():
        prompt = torch.randint(0, VOCAB, (1, 200))
        model(prompt, torch.arange(200)[None], cache, chain_mask(0, 200))
        cache.truncate(200)
        ours, theirs = [float("inf")] * len(sizes), [float("inf")] * len(sizes)
        for _ in range(args.rounds):
            ours = [min(a, forward_ms(model, cache, 200, m, args.repeats)) for a, m in zip(ours, sizes)]
            theirs = [min(a, b) for a, b in zip(theirs, llamacpp_row(str(path), sizes, args.repeats, 0)[0])]
        curve = measure(model) if args.curve else None
    print(f"{args.shape}, {args.layers} layers in {args.blocks} (experts {experts}), {torch.get_num_threads()} threads, after 200 cached "
          f"tokens; ms per forward, best of {args.repeats} x {args.rounds} rounds (per layer in brackets)")
    print("| engine | " + " | ".join(f"M={m}" for m in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for name, times in (("specdecode (stored)", ours), ("llama.cpp", theirs)):
        print(f"| {name} | " + " | ".join(f"{t:.1f} ({t / args.layers:.2f})" for t in times) + " |")
    print("| ours / llama.cpp | " + " | ".join(f"{a / b:.2f}x" for a, b in zip(ours, theirs)) + " |")
    if curve is not None:
        print("cost curve (ms, M = 1..):", ", ".join(f"{t * 1000:.1f}" for t in curve.seconds))


if __name__ == "__main__":
    main()
