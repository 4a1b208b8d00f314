"""Qwen3-Next on the native model: parity with transformers' Qwen3NextForCausalLM on a tiny random config (gated
DeltaNet layers beside gated full attention, experts with a shared expert beside a dense layer), and the recurrent
state under speculation: a verify forward's rows are its one-token forwards', a rollback restores the state after
the last accepted row exactly, a tree's nodes continue from their parents', and every method's greedy output
equals plain decoding's."""

import pytest
import torch
from native_families import (
    PROMPT,
    VOCAB,
    check_every_method,
    check_greedy_equals_transformers,
    check_hf_folder_loads_natively,
    check_tree_forward,
    drafters,
    native,
    run,
)

from specdecode.config import ModelConfig, runs_natively
from specdecode.engine.engine import Engine
from specdecode.models.deltanet import GatedDeltaNet
from specdecode.models.experts import SparseMoE
from specdecode.models.kv_cache import bytes_per_token
from specdecode.models.masks import chain_mask, depths, tree_mask
from specdecode.models.model import Transformer
from specdecode.models.state_cache import KEPT_STATES, StateCache
from specdecode.weights.quantize import quantize_

LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]


def next_hf(seed: int = 0, **overrides):
    """A tiny Qwen3NextForCausalLM: layers 0 and 2 gated DeltaNet (2 key heads serving 4 value heads), 1 and 3
    gated attention with a quarter of each head rotating; 8 experts, 2 a token, and a shared expert, layer 1's MLP
    dense. Norms, gates and decay rates random, so that each term counts."""
    import transformers

    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=LAYER_TYPES,
                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                  mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=256, eos_token_id=None,
                  pad_token_id=0, bos_token_id=None)
    config = transformers.Qwen3NextConfig(**dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # applied as is
                p.normal_(1, 0.3)
            elif "norm" in name:  # applied as 1 + w
                p.normal_(0, 0.3)
            elif name.endswith("gate.weight") or "A_log" in name or "dt_bias" in name:
                p.normal_(0, 0.5)
    return model


def feed(model: Transformer, cache, ids: list[int], start: int) -> torch.Tensor:
    """`ids` as one chain of decode rows at slots start, start + 1, ... -> their logits [len, vocab]; the cache's
    length then follows them."""
    n = len(ids)
    logits, _ = model(torch.tensor([ids]), torch.arange(start, start + n)[None], cache, chain_mask(start, n),
                      decode=True)
    cache.truncate(start + n)
    return logits[0]


def recurrent_states(cache: StateCache, length: int) -> list[torch.Tensor]:
    return [t for layer in range(cache.recurrent_layers) for t in cache.state(length, layer)]


def test_config_flags_and_layers():
    hf = next_hf()
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert type(hf).__name__ == "Qwen3NextForCausalLM" and runs_natively(hf.config.to_dict())
    assert config.linear_layers == (0, 2) and config.attention_layers == (1, 3) and config.moe_layers == (0, 2, 3)
    assert config.rotary_dim == 4 and config.attention_output_gate and config.norm_unit_offset and config.qk_norm
    assert config.shared_expert_intermediate_size == 16 and not config.llama_layers
    model = native(hf)
    blocks = model.model.layers
    assert isinstance(blocks[0].linear_attn, GatedDeltaNet) and not hasattr(blocks[0], "self_attn")
    assert isinstance(blocks[3].mlp, SparseMoE) and blocks[3].mlp.shared and not isinstance(blocks[1].mlp, SparseMoE)
    cache = model.new_cache(1, 16)
    assert isinstance(cache, StateCache) and cache.k.shape[0] == 2  # keys and values of the attention layers only
    assert bytes_per_token(model) == 2 * 2 * 2 * 16 * 4  # two layers' keys and values, two heads of 16, float32


def test_a_published_style_config():
    """The layout as the released config.json writes it: no layer_types (every 4th layer attends) and the partial
    rotary factor beside rope_theta at the top level."""
    hf = {k: v for k, v in next_hf().config.to_dict().items() if k not in ("layer_types", "rope_parameters")}
    hf.update(num_hidden_layers=8, full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=1e7)
    config = ModelConfig.from_hf(hf)
    assert config.linear_layers == (0, 1, 2, 4, 5, 6) and config.attention_layers == (3, 7)
    assert config.rotary_dim == 4 and config.rope_theta == 1e7 and config.rope_scaling is None


@torch.no_grad()
def test_logits_match_transformers():
    hf = next_hf()
    model = native(hf)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    for decode in (False, True):
        out, _ = model(ids, torch.arange(16)[None], model.new_cache(1, 32), chain_mask(0, 16), decode=decode)
        assert torch.allclose(out, ref, atol=1e-5), (decode, (out - ref).abs().max())
    cache, pieces = model.new_cache(1, 32), []
    for start, end in [(0, 3), (3, 4), (4, 9), (9, 16)]:  # the state carried across forwards
        pieces.append(feed(model, cache, ids[0, start:end].tolist(), start))
    assert torch.allclose(torch.cat(pieces), ref[0], atol=1e-5)


def test_greedy_tokens_equal_transformers():
    check_greedy_equals_transformers(next_hf())


@pytest.mark.parametrize("form", ["python", "none"])
@torch.no_grad()
def test_verify_rows_equal_one_row_at_a_time(form):
    """k rows in one forward against each row alone: the same argmax; on the kernels the same bits, logits and
    states."""
    model = native(next_hf())
    if form != "python":
        quantize_(model, form)
    prefix = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    rows = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(3)).tolist()
    together_cache, alone_cache = model.new_cache(1, 32), model.new_cache(1, 32)
    feed(model, together_cache, prefix, 0)
    feed(model, alone_cache, prefix, 0)
    together = feed(model, together_cache, rows, 6)
    alone = torch.cat([feed(model, alone_cache, [token], 6 + j) for j, token in enumerate(rows)])
    assert torch.equal(together.argmax(-1), alone.argmax(-1))
    if form == "python":
        assert torch.allclose(together, alone, atol=1e-5)
        return
    assert torch.equal(together, alone)
    for length in range(7, 15):
        assert all(map(torch.equal, recurrent_states(together_cache, length), recurrent_states(alone_cache, length)))


@pytest.mark.parametrize("form", ["python", "none"])
@torch.no_grad()
def test_rollback_restores_the_state_exactly(form):
    """k rows verified, then the cache cut back to j of them: what follows is what follows j rows fed alone (on the
    kernels the same bits; in torch the same values), for every j, back to the forward's start."""
    model = native(next_hf())
    if form != "python":
        quantize_(model, form)
    prefix = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(4)).tolist()
    draft = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(5)).tolist()
    after = [7, 8, 9]
    for j in range(0, 6):
        cut = model.new_cache(1, 32)
        feed(model, cut, prefix, 0)
        feed(model, cut, draft, 6)
        cut.truncate(6 + j)  # only j rows accepted
        fresh = model.new_cache(1, 32)
        feed(model, fresh, prefix + draft[:j], 0)
        if form != "python":
            assert all(map(torch.equal, recurrent_states(cut, 6 + j), recurrent_states(fresh, 6 + j))), j
        went_on, ref = feed(model, cut, after, 6 + j), feed(model, fresh, after, 6 + j)
        assert torch.equal(went_on, ref) if form != "python" else torch.allclose(went_on, ref, atol=1e-5), j


def test_tree_forward_equals_each_path():
    check_tree_forward(native(next_hf()))


@torch.no_grad()
def test_a_tree_step_keeps_its_accepted_path():
    """A tree verified, its accepted path (not a prefix of the rows) compacted with keep: the state is that path's
    and decoding goes on as if the path had been fed as a chain."""
    model = native(next_hf())
    quantize_(model, "none")
    prefix = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(6)).tolist()
    root, nodes, parents = 7, [10, 11, 12, 13, 14], torch.tensor([-1, -1, 1, 0, 2])
    cache = model.new_cache(1, 32)
    feed(model, cache, prefix, 0)
    ids = torch.tensor([[root, *nodes]])
    positions = (6 + torch.cat((torch.zeros(1, dtype=torch.long), depths(parents))))[None]
    model(ids, positions, cache, tree_mask(6, parents), decode=True)
    cache.truncate(7)
    cache.keep([7 + node for node in (1, 2, 4)])  # root -> node 1 -> node 2 -> node 4
    chain = model.new_cache(1, 32)
    feed(model, chain, prefix + [root, 11, 12, 14], 0)
    assert cache.length == chain.length == 10
    assert all(map(torch.equal, recurrent_states(cache, 10), recurrent_states(chain, 10)))
    assert torch.equal(feed(model, cache, [3, 4], 10), feed(model, chain, [3, 4], 10))


def test_a_rollback_past_the_kept_states_is_refused():
    model = native(next_hf())
    cache = model.new_cache(1, KEPT_STATES + 40)
    with torch.no_grad():
        feed(model, cache, [1] * (KEPT_STATES + 20), 0)
    cache.truncate(KEPT_STATES + 10)  # within the kept slots
    with pytest.raises(ValueError, match="no recurrent state is kept at length 5"):
        cache.truncate(5)


@pytest.mark.parametrize("form", ["python", "kernels", "kernels-bf16-kv"])
def test_every_method_gives_plain_decodings_tokens(form):
    check_every_method(native(next_hf()), native(next_hf(seed=1)), form)


@torch.no_grad()
def test_an_hf_folder_loads_natively(tmp_path):
    check_hf_folder_loads_natively(next_hf(), tmp_path)


def test_the_cost_curve_measures():
    """The planner times verify forwards on a cache that stands for a long prompt without computing it (zero
    states, as zero keys), and rolls it back between runs."""
    from specdecode.planner.budget import measure

    curve = measure(native(next_hf()), max_tokens=3, prefix=8, repeats=1, batch_sizes=())
    assert len(curve.seconds) == 3 and all(s > 0 for s in curve.seconds)


@pytest.mark.parametrize("method", ["ngram-tree", "self-draft-tree"])
def test_requests_batched_give_their_own_tokens(method):
    """Requests joining a running batch (one ragged forward, a state cache each, their trees side by side) give
    the tokens each gives alone."""
    from test_batch import run_batch

    from specdecode.config import SamplingParams

    target = quantize_(native(next_hf()), "none")
    prompts = [PROMPT, [5, 9, 5, 9, 5, 9, 3], list(range(20, 40))]
    params = SamplingParams(max_new_tokens=12)
    alone = [run(Engine(target, drafters(target, target)[method], num_draft_tokens=4), p, 12) for p in prompts]
    engine = Engine(target, drafters(target, target)[method], num_draft_tokens=4)
    assert run_batch(engine, [(p, params) for p in prompts], arrivals=[0, 1, 3]) == alone


SAMPLED_TRIALS = 800  # a third of test_sampling_new_families.py's, to stay fast: the L1 bound widens to match


@pytest.mark.parametrize("width", [1, 2])
def test_sampled_outputs_follow_the_targets_distribution(width):
    """Under sampling, drafts rejected part-way roll the state back at every step: a draft model's chain
    (temperature 1) and tree (top-3 at 0.6) over four tokens, every output of three tokens enumerated exactly."""
    from test_sampling_new_families import EOS, exact_outputs, seeded
    from toy import assert_exact_distribution

    from specdecode.config import SamplingParams
    from specdecode.drafters import DraftModelDrafter

    def tiny(seed: int) -> Transformer:
        hf = next_hf(seed, vocab_size=4)
        with torch.no_grad():  # random tiny models give near-uniform logits: sharpened, drafts get rejected
            hf.model.norm.weight.copy_(8.0 * (1 + hf.model.norm.weight) - 1)
        return quantize_(native(hf), "none")

    target, draft = tiny(0), tiny(1)
    target.config.eos_token_ids = (EOS,)
    params = (SamplingParams(temperature=1.0, max_new_tokens=3) if width == 1
              else SamplingParams(temperature=0.6, top_k=3, max_new_tokens=3))
    prompt = [0, 1, 2, 1, 0, 2]
    exact = exact_outputs(target, prompt, params)
    engine = Engine(target, DraftModelDrafter(draft, vocab_size=4, width=width), num_draft_tokens=4)
    counts: dict[tuple, int] = {}
    rejected = 0
    for i in range(SAMPLED_TRIALS):
        out = tuple(t for step in engine.generate(prompt, seeded(params, i)) for t in step.tokens)
        counts[out] = counts.get(out, 0) + 1
        rejected += sum(engine.last.stats.accepted_at) < sum(engine.last.stats.drafted_at)
    assert rejected > SAMPLED_TRIALS / 20, rejected  # rollbacks happened
    assert_exact_distribution(counts, exact)
