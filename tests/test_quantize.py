"""The native CPU kernels and the weight formats on them: right numbers, rows independent of the batch, and
speculation exact relative to the target as run (float32, bf16, and weights in Q8_0 / Q4_K blocks)."""

import pytest
import torch
from tiny import tiny_native

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine.engine import Engine
from specdecode.kernels import cpu_kernels
from specdecode.models.masks import chain_mask
from specdecode.weights.quantize import HalfEmbedding, KernelLinear, QuantLinear, quantize_, widen_embedding_

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
WIDE = dict(hidden_size=256, intermediate_size=512)  # whole Q4_K superblocks along every input dimension


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_kernel_matches_the_float_layer(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 70, bias=True).to(dtype)  # 70 rows: a ragged last block of weight rows
    layer = KernelLinear(linear, kernels)
    x = torch.randn(5, 96).to(dtype)
    out = layer(x).float()
    exact = x.float() @ linear.weight.float().T + linear.bias.float()
    assert torch.allclose(out, exact, atol=1e-4 if dtype == torch.float32 else 0.05, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_float_kernel_rows_are_computed_as_if_alone(dtype):
    torch.manual_seed(0)
    layer = KernelLinear(torch.nn.Linear(256, 38, bias=False).to(dtype), kernels)
    x = torch.randn(13, 256).to(dtype)
    for rows in (2, 3, 5, 7, 13):
        batch = layer(x[:rows])
        for j in range(rows):
            assert torch.equal(batch[j], layer(x[j : j + 1])[0])


tiles = pytest.mark.skipif(kernels is None or not kernels.bf16_tiles_on(), reason="bfloat16 tiles need AMX")


def bf16_weights(model):
    """`model`'s linear matrices in bfloat16 under float32 activations: a bfloat16 checkpoint as stored."""
    made = {}  # a head tied to the embedding stays tied: one bfloat16 matrix for both
    for module in model.modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            old = module.weight
            if id(old) not in made:
                made[id(old)] = torch.nn.Parameter(old.detach().bfloat16(), requires_grad=False)
            module.weight = made[id(old)]
    return widen_embedding_(model)


@tiles
def test_bf16_tiles_compute_rows_as_if_alone_and_round_only_the_inputs():
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 48, bias=True).bfloat16()
    layer = KernelLinear(linear, kernels)
    assert layer.tiles is not None and torch.equal(layer.weight, linear.weight)  # rows given back as they were
    x = torch.randn(37, 256)
    out = layer(x)
    exact = x.bfloat16().float() @ linear.weight.float().T + linear.bias.float()
    assert torch.allclose(out, exact, atol=1e-4, rtol=1e-5)  # float32 sums of bfloat16 inputs
    for rows in (1, 2, 5, 16, 17, 37):
        batch = layer(x[:rows])
        assert all(torch.equal(batch[j], layer(x[j : j + 1])[0]) for j in range(rows)), rows
    logits, argmax = layer.forward_argmax(x[:5])
    assert torch.equal(logits, out[:5]) and torch.equal(argmax, out[:5].argmax(-1))


@tiles
def test_a_tied_head_on_tiles_keeps_the_embeddings_rows():
    model = quantize_(bf16_weights(tiny_native("qwen2", seed=0, tie_word_embeddings=True, **WIDE)), "none")
    assert model.lm_head.tiles is not None and model.lm_head.weight is model.model.embed_tokens.weight
    assert "weight" not in model.model.layers[0].self_attn.q_proj._parameters  # untied: the tiles alone
    assert isinstance(model.model.embed_tokens, HalfEmbedding) and model.model.embed_tokens.native is not None


@pytest.mark.parametrize("mode", ["q8_0", "q4_0", "q4_k"])
def test_quantize_puts_every_linear_in_blocks(mode):
    model = quantize_(tiny_native("qwen2", seed=0, **WIDE), mode)
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, KernelLinear, QuantLinear))]
    assert linears and all(isinstance(m, QuantLinear) and m.format.name == mode for m in linears)


@pytest.mark.parametrize("mode, dtype", [("none", torch.float32), ("none", torch.bfloat16), ("q4_k", torch.float32),
                                         ("q8_0", torch.bfloat16)])
def test_decode_forward_rows_equal_one_token_forwards(mode, dtype):
    model = quantize_(tiny_native("qwen2", seed=0, dtype=dtype, **WIDE), mode)
    tokens = torch.tensor([[5, 9, 2, 7, 1, 3, 3, 8, 4, 6]])
    prefix, new = 4, 6
    with torch.inference_mode():
        cache = model.new_cache(1, 32)
        model(tokens[:, :prefix], torch.arange(prefix)[None], cache, chain_mask(0, prefix))
        cache.truncate(prefix)
        batch, _ = model(tokens[:, prefix:], torch.arange(prefix, prefix + new)[None], cache,
                         chain_mask(prefix, new), decode=True)
        for j in range(new):
            cache.truncate(prefix + j)
            pos = prefix + j
            one, _ = model(tokens[:, pos : pos + 1], torch.tensor([[pos]]), cache, chain_mask(pos, 1), decode=True)
            assert torch.equal(batch[0, j], one[0, 0]), f"row {j} differs"


def test_bf16_weights_under_float32_activations_decode_rows_as_one_token_forwards(switch_both_ways):
    """A bfloat16 checkpoint as stored (on tiles where the CPU has AMX): a verify forward's rows, in the native
    decode stack on one thread or two, are bit for bit one-token forwards, and speculation equals plain decoding."""
    target = quantize_(bf16_weights(tiny_native("qwen2", seed=0, **WIDE)), "none")
    tokens = torch.tensor([[5, 9, 2, 7, 1, 3, 3, 8, 4, 6]])

    def rows_and_ones():
        with torch.inference_mode():
            cache = target.new_cache(1, 32)
            target(tokens[:, :4], torch.arange(4)[None], cache, chain_mask(0, 4))
            cache.truncate(4)
            batch, _ = target(tokens[:, 4:], torch.arange(4, 10)[None], cache, chain_mask(4, 6), decode=True)
            ones = []
            for j in range(6):
                cache.truncate(4 + j)
                one, _ = target(tokens[:, 4 + j : 5 + j], torch.tensor([[4 + j]]), cache, chain_mask(4 + j, 1),
                                decode=True)
                ones.append(one[0, 0])
            return batch[0], torch.stack(ones)

    for batch, ones in switch_both_ways("team", rows_and_ones):
        assert torch.equal(batch, ones)
    assert target.native.built is not None  # the decode forwards ran in the native stack
    draft = quantize_(bf16_weights(tiny_native("qwen2", seed=1, **WIDE)), "none")
    prompt, params = [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=24)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    for drafter in (NgramDrafter(), DraftModelDrafter(draft, vocab_size=64)):
        engine = Engine(target, drafter, num_draft_tokens=3)
        assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain


@pytest.mark.parametrize("mode", ["none", "q8_0", "q4_0", "q4_k"])
def test_speculation_is_exact_for_the_target_as_run(mode):
    target = quantize_(tiny_native("qwen2", seed=0, dtype=torch.bfloat16, **WIDE), mode)
    draft = quantize_(tiny_native("qwen2", seed=1, dtype=torch.bfloat16, **WIDE), mode)
    assert not any(isinstance(m, torch.nn.Linear) for m in target.modules())
    prompt, params = [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=24)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    self_draft = Engine(target, DraftModelDrafter(target, vocab_size=64), num_draft_tokens=3)
    assert [t for s in self_draft.generate(prompt, params) for t in s.tokens] == plain
    for drafter in (NgramDrafter(), DraftModelDrafter(draft, vocab_size=64)):
        engine = Engine(target, drafter, num_draft_tokens=3)
        assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain


@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
def test_greedy_verification_reads_the_argmax_the_head_found(mode, monkeypatch):
    """A float32 target on blocks: greedy verification takes each row's argmax as the LM head found it while
    writing the logits, and every method's output is plain decoding's."""
    from specdecode.weights.quantize import QuantLinear

    found = []
    plain_call = QuantLinear.forward_argmax

    def counted(self, x):
        out = plain_call(self, x)
        found.append(out[1].numel())
        return out

    monkeypatch.setattr(QuantLinear, "forward_argmax", counted)
    target = quantize_(tiny_native("qwen2", seed=0, **WIDE), mode)
    draft = quantize_(tiny_native("qwen2", seed=1, **WIDE), mode)
    prompt, params = [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=24)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    assert len(found) >= 23 and all(found)
    for drafter in (NgramDrafter(), DraftModelDrafter(draft, vocab_size=64)):
        engine = Engine(target, drafter, num_draft_tokens=3)
        assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain


def test_unknown_mode_is_refused():
    with pytest.raises(Exception, match="unknown quantization"):
        quantize_(tiny_native("qwen2"), "int3")



@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
def test_sampling_self_draft_on_blocks_is_always_accepted(mode):
    """Under sampling a draft accepted with probability min(1, p / q): drafting with the target itself on the
    integer kernels must give p == q bit for bit at every position, so every draft token is kept."""
    target = quantize_(tiny_native("qwen2", seed=0, **WIDE), mode)
    engine = Engine(target, DraftModelDrafter(target, vocab_size=64), num_draft_tokens=4)
    params = SamplingParams(max_new_tokens=32, temperature=0.8, seed=3)
    tokens = [t for s in engine.generate([1, 2, 3, 4], params) for t in s.tokens]
    assert len(tokens) == 32 and engine.last.stats.drafted_tokens > 0 and engine.last.stats.acceptance_rate == 1.0


def test_embedding_rows_are_the_same_from_its_cache(monkeypatch):
    """Without the CPU kernels, decode steps' embedding rows come from a small cache of recent tokens: the same
    bits as de-quantizing them, duplicates and evictions included."""
    from specdecode.weights.blocks import quantize_float
    from specdecode.weights.quantize import QuantEmbedding

    packed = quantize_float(torch.randn(50, 64), "q8_0")
    embedding = QuantEmbedding(packed, torch.float32)
    embedding._native = None  # the path without the CPU kernels
    monkeypatch.setattr(QuantEmbedding, "CACHED_ROWS", 4)
    for ids in ([[3]], [[3, 7, 3, 9]], [[1, 2, 5, 7, 3]], [[3, 1]], [list(range(40))], [[49, 0]]):
        tokens = torch.tensor(ids)
        expected = packed.rows(tokens.reshape(-1)).dequantize().view(*tokens.shape, -1)
        assert torch.equal(embedding(tokens), expected)
        assert len(embedding._rows) <= 4


def test_sampled_output_is_the_bfloat16_targets_distribution():
    """A bfloat16 checkpoint as stored (on tiles where the CPU has AMX), a draft model's trees: three sampled tokens
    (top-3 of each step) follow the target's own distribution, chi-by-L1 bound at a fixed seed per trial."""
    from toy import assert_exact_distribution

    from specdecode.sampling import to_probs

    target = quantize_(bf16_weights(tiny_native("qwen2", seed=0, **WIDE)), "none")
    draft = quantize_(bf16_weights(tiny_native("qwen2", seed=1, **WIDE)), "none")
    prompt, params = [1, 2, 3], SamplingParams(temperature=0.7, top_k=3, max_new_tokens=3)

    def probs_after(tokens):
        with torch.inference_mode():
            cache = target.new_cache(1, 16)
            logits, _ = target(torch.tensor([tokens]), torch.arange(len(tokens))[None], cache,
                               chain_mask(0, len(tokens)), decode=True)
        return torch.as_tensor(to_probs(logits[0, -1:].float(), params))[0]

    exact = {(): 1.0}
    for _ in range(params.max_new_tokens):  # every output's probability, token by token
        exact = {out + (t,): p * float(q[t]) for out, p in exact.items()
                 for q in [probs_after(prompt + list(out))] for t in q.nonzero().flatten().tolist()}
    engine = Engine(target, DraftModelDrafter(draft, vocab_size=64, width=2), num_draft_tokens=3)
    counts: dict[tuple, int] = {}
    drafted = 0
    for seed in range(3000):
        out = tuple(t for s in engine.generate(prompt, SamplingParams(**{**params.__dict__, "seed": seed}))
                    for t in s.tokens)
        counts[out] = counts.get(out, 0) + 1
        drafted += engine.last.stats.drafted_tokens
    assert drafted > 3000
    assert_exact_distribution(counts, exact)
