"""The static-buffer forwards that CUDA graphs replay (cuda_graphs.py), run eagerly on the CPU (capture=False):
rows padded to a power of two, attention over a power-of-two window under a mask, caches the model lends. A GPU
run of the same code with capture is scripts/gpu_check.py's `graphs` sections."""

import gc

import pytest
import torch
from tiny import tiny_native

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.draft_model import TREE_EXPAND, TREE_WIDTH
from specdecode.engine.engine import Engine
from specdecode.models.cuda_graphs import LENT_CACHES, bucket, use_graphs
from specdecode.models.parts import Part, RowSlots, chain_part
from specdecode.planner.planner import Planner

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 1, 2]


def run(engine: Engine, params: SamplingParams) -> list[int]:
    return [t for step in engine.generate(PROMPT, params) for t in step.tokens]


@pytest.fixture(autouse=True)
def costs_as_given(monkeypatch):
    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


def test_bucket_is_the_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, 256) == 256 and bucket(300, 256) == 512


def filled_cache(model, length: int):
    cache = model.new_cache(1, 128)
    ids = torch.arange(length) % 60 + 1
    model.forward_parts([chain_part(ids, cache)])
    cache.truncate(length)
    return cache


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("rows_apart", [False, True])  # attention in one call, or per row
@torch.inference_mode()  # as the engine steps: the graphs never run where gradients are recorded
def test_a_padded_forward_gives_the_rows_of_the_eager_one(tree, rows_apart):
    model = tiny_native("qwen2", seed=0)
    tokens = torch.tensor([7, 8, 9, 10, 11])  # 5 rows: the 8-row shape, 3 padded
    if tree:  # root, two children of the root, a grandchild under each
        spans, extras = [11, 11, 11, 12, 11], [[], [11], [12], [13], [12, 14]]  # slots 10 ... 14
        positions = torch.tensor([10, 11, 11, 12, 12])
    else:
        spans, extras, positions = [11, 12, 13, 14, 15], [], torch.arange(10, 15)
    for logits_from in (0, 4, 2):
        eager_cache = filled_cache(model, 10)
        want = model.forward_parts([Part(tokens, positions, eager_cache, None, logits_from,
                                         rows=RowSlots(spans, extras))])[0]
        use_graphs(model, capture=False, rows_apart=rows_apart)
        cache = filled_cache(model, 10)
        assert model.graphs.knows(cache)
        got = model.forward_parts([Part(tokens, positions, cache, None, logits_from, rows=RowSlots(spans, extras))])[0]
        assert model.graphs.shapes and model.graphs.mask_rows == rows_apart, "the static path ran"
        use_graphs(model, False)
        assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(cache.k[:, :, :, :15], eager_cache.k[:, :, :, :15])  # the real rows' keys


def drafters(target):
    draft = lambda: tiny_native("qwen2", seed=1).to(target.device)  # noqa: E731
    return {
        "none": NoDrafter(),
        "ngram": NgramDrafter(),
        "ngram-tree": NgramDrafter(branches=4),
        "self-draft": DraftModelDrafter(target, vocab_size=64),
        "draft-model-tree": DraftModelDrafter(draft(), vocab_size=64, width=TREE_WIDTH, expand=TREE_EXPAND),
        "hybrid": HybridDrafter(DraftModelDrafter(draft(), vocab_size=64)),
    }


def test_greedy_is_token_identical_through_the_static_forwards():
    target = tiny_native("qwen2", seed=0)
    params = SamplingParams(max_new_tokens=40)
    reference = run(Engine(target, NoDrafter()), params)
    for name, drafter in drafters(target).items():
        for model in {target, drafter.needs.forward_model} - {None}:
            use_graphs(model, capture=False)
        engine = Engine(target, drafter, num_draft_tokens=6)
        assert run(engine, params) == reference, name
        assert target.graphs.shapes, name
        for model in {target, drafter.needs.forward_model} - {None}:
            use_graphs(model, False)


def test_windows_wider_than_the_first_and_a_forward_past_the_cache_run_alike():
    target = tiny_native("qwen2", seed=0, max_position_embeddings=2048)
    prompt = [(7 * i) % 60 + 1 for i in range(300)]  # the window passes 256, then 512
    params = SamplingParams(max_new_tokens=240)
    reference = [t for step in Engine(target, NoDrafter()).generate(prompt, params) for t in step.tokens]
    use_graphs(target, capture=False)
    engine = Engine(target, DraftModelDrafter(target, vocab_size=64), num_draft_tokens=6)
    assert [t for step in engine.generate(prompt, params) for t in step.tokens] == reference
    assert {key[2] for key in target.graphs.shapes} >= {512, 1024}  # the windows the graphs read
    del engine  # its request's cache, and its self-draft's, go back
    gc.collect()
    cache = target.new_cache(1, 64)
    assert target.graphs.knows(cache)
    with torch.inference_mode():
        assert target.graphs.run(chain_part(torch.tensor([1, 2, 3]), cache), ()) is not None
        cache.truncate(cache.max_len - 2)
        assert target.graphs.run(chain_part(torch.tensor([1, 2, 3]), cache), ()) is None  # 4 rows would not fit


def test_lent_caches_come_back_and_a_grown_one_runs_eagerly():
    model = tiny_native("qwen2", seed=0)
    use_graphs(model, capture=False)
    graphs = model.graphs
    first = model.new_cache(1, 64)
    assert first.max_len == graphs.cache_len and graphs.knows(first)
    buffers = first.k
    del first
    gc.collect()
    again = model.new_cache(1, 64)
    assert again.k is buffers and again.length == 0  # the same buffers: the graphs captured for them serve it
    others = [model.new_cache(1, 64) for _ in range(LENT_CACHES)]
    assert not any(graphs.knows(c) for c in others[LENT_CACHES - 1 :])  # all lent: a plain cache
    assert model.new_cache(1, graphs.cache_len + 1).max_len == graphs.cache_len + 1  # longer than lent ones
    again.grow(graphs.cache_len * 2)
    assert not graphs.knows(again)
    part = chain_part(torch.tensor([1, 2]), again)
    assert graphs.run(part, ()) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_greedy_is_token_identical_replayed_as_cuda_graphs():
    target = tiny_native("qwen2", seed=0).cuda()
    params = SamplingParams(max_new_tokens=40)
    reference = run(Engine(target, NoDrafter(), cuda_graphs=False), params)
    assert target.graphs is None
    # the engine turns them on for its models on a GPU (cuda_graphs=True by default)
    for name, drafter in drafters(target).items():
        engine = Engine(target, drafter, num_draft_tokens=6)
        assert run(engine, params) == reference, name
        assert target.graphs.shapes and all(s.graph is not None for s in target.graphs.shapes.values()), name
        if drafter.needs.forward_model is not None and drafter.needs.forward_model is not target:
            assert drafter.needs.forward_model.graphs.shapes, name


def test_shapes_are_made_again_when_the_weights_move_and_buffers_serve_any_grad_mode():
    model = tiny_native("qwen2", seed=0)
    use_graphs(model, capture=False)
    with torch.inference_mode():  # buffers first made here (as in an engine's step) ...
        cache = model.new_cache(1, 64)
        first = model.forward_parts([chain_part(torch.tensor([1, 2, 3]), cache)])[0][0]
    assert model.graphs.shapes
    with torch.no_grad():  # ... still written outside it
        cache.truncate(0)
        again = model.forward_parts([chain_part(torch.tensor([1, 2, 3]), cache)])[0][0]
        torch.testing.assert_close(again, first)
        model.lm_head.weight.data = model.lm_head.weight.data * 2  # new storage: a graph would read the old one
        cache.truncate(0)
        doubled = model.forward_parts([chain_part(torch.tensor([1, 2, 3]), cache)])[0][0]
    assert len(model.graphs.shapes) == 1  # the old shape dropped, this forward's made
    torch.testing.assert_close(doubled, first * 2)


def test_requests_served_together_and_then_alone_give_their_alone_tokens():
    target = tiny_native("qwen2", seed=0)
    long, short = SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=5)
    alone = {n: run_prompt(Engine(target, NoDrafter()), PROMPT[:n], p) for n, p in ((13, long), (12, short))}
    use_graphs(target, capture=False)
    engine = Engine(target, NgramDrafter(), num_draft_tokens=4)
    first, second = engine.add(PROMPT, long), engine.add(PROMPT[:-1], short)
    assert target.graphs.knows(first.cache) and target.graphs.knows(second.cache)
    while engine.running:  # together (each step one ragged forward, eager), then the first alone (graphs)
        engine.step()
    assert first.tokens[13:] == alone[13] and second.tokens[12:] == alone[12]
    assert target.graphs.shapes


def test_a_seeded_sampled_tree_draws_the_same_tokens_through_the_static_forwards():
    target, draft = tiny_native("qwen2", seed=0), tiny_native("qwen2", seed=1)
    params = SamplingParams(max_new_tokens=30, temperature=0.8, seed=3)
    drafter = lambda: DraftModelDrafter(draft, vocab_size=64, width=3, expand=1)  # noqa: E731
    eager = run_prompt(Engine(target, drafter(), num_draft_tokens=6), PROMPT, params)
    use_graphs(target, capture=False)
    use_graphs(draft, capture=False)
    assert run_prompt(Engine(target, drafter(), num_draft_tokens=6), PROMPT, params) == eager
    assert target.graphs.shapes and draft.graphs.shapes


def run_prompt(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t for step in engine.generate(prompt, params) for t in step.tokens]
