"""Recent prompts' keys and values reused: a request that starts like an earlier one computes only the rest, and
its output is exactly what it would be without them (greedy and seeded sampling, alone and in a batch)."""

import pytest
import torch
from test_batch import WIDE, needs_kernels
from tiny import tiny_native

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NoDrafter
from specdecode.engine.engine import Engine
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecdecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.models.prompt_cache import PromptCache
from specdecode.planner.planner import Planner
from specdecode.server.formats import usage
from specdecode.weights.quantize import quantize_

pytestmark = needs_kernels

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 1, 2]
LONGER = PROMPT + [7, 8, 3, 3]  # a next turn: the earlier prompt, then more
OTHER = [1, 2, 3, 4, 40, 41, 42]  # shares its first four tokens


@pytest.fixture(autouse=True)
def costs_as_given(monkeypatch):
    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


@pytest.fixture(scope="module")
def target():
    # Weights in blocks on the CPU kernel, as a GGUF target runs: each row is computed as if alone, so a copied row
    # is bit for bit the row a prefill writes (a plain torch Linear is not row-exact: its one-row products round
    # differently).
    return quantize_(tiny_native("qwen2", seed=0, **WIDE), "q8_0")


def drafter(seed: int = 1, **kw) -> DraftModelDrafter:
    """A draft model on the kernels (rows exact), so it keeps its prompts too."""
    return DraftModelDrafter(quantize_(tiny_native("qwen2", seed=seed, **WIDE), "q8_0"), vocab_size=64, **kw)


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t for step in engine.generate(prompt, params) for t in step.tokens]


def cache_of(n: int, layers: int = 2, fill: float | None = None) -> KVCache:
    cache = KVCache(layers, 1, 2, n, 4, torch.float32)
    if fill is None:
        cache.k.copy_(torch.arange(cache.k.numel(), dtype=torch.float32).view_as(cache.k))
        cache.v.copy_(-cache.k)
    cache.truncate(n)
    return cache


def test_restores_the_longest_shared_prefix_within_the_limit():
    store = PromptCache(1)
    store.store([1, 2, 3, 4], cache_of(4))
    store.store([1, 2, 9], cache_of(3))
    fresh = cache_of(8, fill=0.0)
    fresh.k.zero_()
    assert store.reuse(fresh, [1, 2, 3, 4, 5], limit=4) == 4
    assert fresh.length == 4 and torch.equal(fresh.k[:, :, :, :4], cache_of(4).k)
    assert store.reuse(fresh, [1, 2, 3, 4], limit=3) == 3  # at least the last token is left to compute
    assert store.reuse(fresh, [5, 1, 2], limit=3) == 0 and fresh.length == 3  # no match: the cache untouched


def test_keeps_a_prompt_once_and_drops_what_a_longer_one_serves():
    store = PromptCache(1)
    store.store([1, 2, 3], cache_of(3))
    store.store([1, 2, 3, 4, 5], cache_of(5))
    assert [p.tokens.tolist() for p in store.prompts] == [[1, 2, 3, 4, 5]]
    store.store([1, 2, 3], cache_of(3))  # within the kept one: nothing new
    assert len(store.prompts) == 1


def test_least_recently_used_prompts_leave_first():
    one = cache_of(4)
    size = one.k.nbytes + one.v.nbytes + 4 * 8
    store = PromptCache(2.5 * size / 2**20)  # room for two
    store.store([1, 1, 1, 1], cache_of(4))
    store.store([2, 2, 2, 2], cache_of(4))
    store.reuse(cache_of(8), [1, 1, 1, 1], 4)  # used: the other one is older now
    store.store([3, 3, 3, 3], cache_of(4))
    assert sorted(p.tokens[0] for p in store.prompts) == [1, 3] and store.nbytes <= store.max_bytes
    off = PromptCache(0)
    off.store([1, 2], cache_of(2))
    assert off.prompts == []
    small = PromptCache(0.5 * size / 2**20)  # less than one prompt: kept prompts stay, the large one is not copied
    small.store([1, 1, 1, 1], cache_of(4))
    assert small.prompts == []
    with pytest.raises(SpecdecodeError, match="prompt-cache-mb"):
        PromptCache(-1)


def test_greedy_output_is_the_same_with_reused_prompts(target):
    params = SamplingParams(max_new_tokens=30)
    plain = Engine(target, NoDrafter())
    expected = {tuple(p): run(plain, p, params) for p in (PROMPT, LONGER, OTHER)}
    engine = Engine(target, NoDrafter(), prompt_cache=PromptCache(4))
    assert run(engine, PROMPT, params) == expected[tuple(PROMPT)]
    assert engine.last.stats.cached_prompt_tokens == 0
    assert run(engine, LONGER, params) == expected[tuple(LONGER)]
    assert engine.last.stats.cached_prompt_tokens == len(PROMPT)
    assert run(engine, OTHER, params) == expected[tuple(OTHER)]
    assert engine.last.stats.cached_prompt_tokens == 4
    assert run(engine, LONGER, params) == expected[tuple(LONGER)]  # the same prompt again: all but its last token
    assert engine.last.stats.cached_prompt_tokens == len(LONGER) - 1


@pytest.mark.parametrize("auto", [False, True])
def test_draft_models_reuse_their_prompts_and_change_nothing(target, auto):
    from test_engine import CPU_LIKE

    params = SamplingParams(max_new_tokens=30)
    expected = {tuple(p): run(Engine(target, NoDrafter()), p, params) for p in (PROMPT, LONGER)}
    draft = drafter()
    for each in (draft, HybridDrafter(drafter(window=7))):
        engine = Engine(target, each, num_draft_tokens=None if auto else 3, costs=CPU_LIKE if auto else None,
                        prompt_cache=PromptCache(4))
        for prompt in (PROMPT, LONGER, LONGER):
            assert run(engine, prompt, params) == expected[tuple(prompt)]
    # each prompt with its answer, as far as the draft fed it (PROMPT's own entry went into the first one)
    kept = sorted(p.tokens.tolist() for p in draft.prompts.prompts)
    assert len(kept) == 2 and all(len(k) > len(PROMPT) for k in kept)
    assert {tuple(k[: len(PROMPT)]) for k in kept} == {tuple(PROMPT)}
    assert any(k[: len(LONGER)] == LONGER for k in kept)


def test_batched_requests_reuse_prompts_and_keep_their_outputs(target):
    from test_batch import run_batch  # noqa: PLC0415

    params = SamplingParams(max_new_tokens=20)
    requests = [(LONGER, params), (OTHER, params), (PROMPT, params)]
    alone = [run(Engine(target, NoDrafter()), p, params) for p, _ in requests]
    engine = Engine(target, drafter(), num_draft_tokens=2,
                    prompt_cache=PromptCache(4))
    run(engine, PROMPT, params)
    assert run_batch(engine, requests, arrivals=[0, 1, 1]) == alone


def test_seeded_sampling_draws_the_same_with_reused_prompts(target):
    params = SamplingParams(max_new_tokens=25, temperature=0.9, top_p=0.95, seed=7)
    make = drafter
    without = run(Engine(target, make(), num_draft_tokens=3), LONGER, params)
    engine = Engine(target, make(), num_draft_tokens=3, prompt_cache=PromptCache(4))
    run(engine, PROMPT, params)
    assert run(engine, LONGER, params) == without
    assert engine.last.stats.cached_prompt_tokens == len(PROMPT)


def test_a_target_whose_rows_are_not_exact_computes_every_prompt():
    plain = tiny_native("qwen2", seed=0)  # torch Linear layers: a one-row product rounds its own way
    assert Engine(plain, NoDrafter(), prompt_cache=PromptCache(4)).prompt_cache is None
    assert DraftModelDrafter(plain, vocab_size=64).prompts is None


def test_prompt_logprobs_compute_every_prompt_row(target):
    engine = Engine(target, NoDrafter(), prompt_cache=PromptCache(4))
    run(engine, PROMPT, SamplingParams(max_new_tokens=4))
    echo = SamplingParams(max_new_tokens=4, prompt_logprobs=1)
    run(engine, PROMPT, echo)
    assert engine.last.stats.cached_prompt_tokens == 0
    assert len(engine.last.prompt_logprobs) == len(PROMPT)


def test_usage_reports_cached_prompt_tokens_as_openai_does():
    stats = GenerationStats(prompt_tokens=20, cached_prompt_tokens=13).to_dict()
    assert usage(stats, "none", 0)["prompt_tokens_details"] == {"cached_tokens": 13}
    assert "prompt_tokens_details" not in usage(GenerationStats(prompt_tokens=20).to_dict(), "none", 0)


@pytest.mark.parametrize("width", [1, 2])  # a chain, and a tree whose accepted nodes move into place
def test_a_finished_answer_is_kept_bit_for_bit_as_a_prefill_would_write_it(target, width):
    """A request's keys and values, verify rows included, are the ones a prefill of its tokens writes: so a chat's
    next turn can start from its prompt and answer."""
    engine = Engine(target, drafter(width=width),
                    num_draft_tokens=4, prompt_cache=PromptCache(4))
    answer = run(engine, PROMPT, SamplingParams(max_new_tokens=30))
    (kept,) = engine.prompt_cache.prompts
    assert kept.tokens.tolist() == (PROMPT + answer)[: len(kept.tokens)] and len(kept.tokens) >= len(PROMPT) + 28
    fresh = Engine(target, NoDrafter())
    next(iter(fresh.generate(kept.tokens.tolist() + [5], SamplingParams(max_new_tokens=1))))
    n = len(kept.tokens)
    assert torch.equal(kept.k, fresh.last.cache.k[:, :, :, :n]) and torch.equal(kept.v, fresh.last.cache.v[:, :, :, :n])


def test_a_next_turn_starts_from_the_last_answer(target):
    params = SamplingParams(max_new_tokens=20)
    engine = Engine(target, drafter(width=2),
                    num_draft_tokens=3, prompt_cache=PromptCache(4))
    answer = run(engine, PROMPT, params)
    turn = PROMPT + answer + [7, 8, 9]
    assert run(engine, turn, params) == run(Engine(target, NoDrafter()), turn, params)
    assert engine.last.stats.cached_prompt_tokens >= len(PROMPT) + len(answer) - 1


@pytest.mark.parametrize("width", [1, 2])  # a chain, and a tree whose accepted nodes move into place
def test_a_draft_model_keeps_its_answer_and_a_next_turn_reads_it_past_its_window(target, width):
    """A finished request's draft cache (prompt and answer, as far as the draft fed them) is kept bit for bit as a
    prefill of those tokens writes it. A next turn longer than the draft's window copies all of it and computes
    only the rest: the window bounds what the draft computes, not what it copies. The output is plain decoding's."""
    from specdecode.drafters.base import DraftContext

    params = SamplingParams(max_new_tokens=20)
    draft = drafter(width=width, window=16)  # PROMPT (13 tokens) fits; the next turn (36) would not
    engine = Engine(target, draft, num_draft_tokens=3, prompt_cache=PromptCache(4))
    answer = run(engine, PROMPT, params)
    (kept,) = draft.prompts.prompts
    n = len(kept.tokens)
    assert kept.tokens.tolist() == (PROMPT + answer)[:n] and n >= len(PROMPT) + len(answer) - 3
    fresh = DraftModelDrafter(draft.model, vocab_size=64, prompts=False)  # the kept tokens as its prompt
    fresh.propose(DraftContext(kept.tokens.tolist() + [5], params, None), 1)
    assert torch.equal(kept.k, fresh.cache.k[:, :, :, :n]) and torch.equal(kept.v, fresh.cache.v[:, :, :, :n])

    turn = PROMPT + answer + [7, 8, 9]
    assert draft.fork().behind(turn + [5]) == len(turn) - n + 1  # the rest of the prompt, and the root
    fed = []  # rows of each draft forward
    plain = draft.model.forward_parts
    draft.model.forward_parts = lambda parts, *a, **k: fed.append(sum(p.count for p in parts)) or plain(parts, *a, **k)
    try:
        assert run(engine, turn, params) == run(Engine(target, NoDrafter()), turn, params)
    finally:
        del draft.model.forward_parts
    assert fed[0] == len(turn) - n and engine.last.drafter.skipped == 0  # the rest of the turn, read whole
    unkept = drafter(width=width, window=16)  # without the kept turn: the window's head and newest tokens
    assert unkept.behind(turn + [5]) == 16 + 1


def test_a_draft_model_whose_rows_are_not_exact_keeps_no_prompts_nor_asks_again_at_each_fork(monkeypatch):
    plain = DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64)
    assert plain.prompts is None and plain.memories() == []
    import specdecode.drafters.draft_model as draft_model

    monkeypatch.setattr(draft_model, "rows_exact", lambda model: pytest.fail("a fork scanned the model again"))
    assert plain.fork().prompts is None


def test_a_request_arriving_mid_answer_copies_the_running_requests_prompt(target):
    """A prompt is copied into the prompt cache when another request arrives (or when its own leaves), not after
    every prefill: a request added while the first decodes still starts from the first's prompt."""
    params = SamplingParams(max_new_tokens=12)
    alone = [run(Engine(target, NoDrafter()), p, params) for p in (PROMPT, LONGER)]
    engine = Engine(target, NoDrafter(), prompt_cache=PromptCache(4))
    first = engine.add(PROMPT, params)
    out = {first: []}
    while first.prefilling or len(first.tokens) < len(PROMPT) + 3:
        out[first] += [t for seq, step in engine.step() for t in step.tokens]
    assert engine.prompt_cache.prompts == []  # not copied yet: no one has asked
    second = engine.add(LONGER, params)
    assert second.stats.cached_prompt_tokens == len(PROMPT)
    out[second] = []
    while engine.running:
        for seq, step in engine.step():
            out[seq] += step.tokens
    assert [out[first], out[second]] == alone


def test_a_cancelled_request_keeps_its_prompt(target):
    engine = Engine(target, NoDrafter(), prompt_cache=PromptCache(4))
    seq = engine.add(PROMPT, SamplingParams(max_new_tokens=20))
    while seq.prefilling:
        engine.step()
    engine.step()
    engine.remove(seq)  # cancelled: no answer to keep, its prompt is
    assert [p.tokens.tolist() for p in engine.prompt_cache.prompts] == [PROMPT]


def test_the_next_request_takes_the_last_ones_cache_and_computes_the_same():
    """A finished request's cache, grown mid-answer and with garbage past its length, serves the next request (which
    copies a shared prompt into it, outside inference mode): outputs as from fresh caches, the target's and the
    draft model's. A spare larger than a request needs counts whole in the KV budget."""
    target = quantize_(tiny_native("qwen2", seed=0, max_position_embeddings=512, **WIDE), "q8_0")
    long, short = SamplingParams(max_new_tokens=280), SamplingParams(max_new_tokens=10)
    expected = [run(Engine(target, NoDrafter()), p, params) for p, params in ((PROMPT, long), (LONGER, long),
                                                                              (OTHER, short))]
    draft = drafter()
    engine = Engine(target, draft, num_draft_tokens=3, prompt_cache=PromptCache(8))
    assert run(engine, PROMPT, long) == expected[0]
    cache, draft_cache = engine.spare.cache, draft.spare.cache
    assert cache is engine.last.cache and cache.max_len > 256  # grown inside a step, in inference mode
    assert draft_cache is not None
    assert run(engine, LONGER, long) == expected[1]
    assert engine.last.cache is cache and engine.last.stats.cached_prompt_tokens == len(PROMPT)
    assert engine.last.stats.drafted_tokens > 0 and engine.last.drafter.spare.cache is draft_cache
    seq = engine.add(OTHER, short)
    assert seq.cache is cache and engine.reserved[seq] == cache.max_len > engine.reservation(len(OTHER), short)
    engine.remove(seq)
    assert run(engine, OTHER, short) == expected[2]
