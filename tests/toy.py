"""Toy models with the engine's forward contract whose output distribution is known exactly."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.models.kv_cache import KVCache
from specdecode.models.model import forward_each


@dataclass
class ToyConfig:
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


class BigramModel(torch.nn.Module):
    """A Markov chain: the next-token logits depend on the current token only; the cache is unused."""

    def __init__(self, probs: torch.Tensor, eos: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.table = probs.log()  # [vocab, vocab]: row = current token
        self.config = ToyConfig(probs.shape[0], eos)
        self.max_context = 1024
        self.device = torch.device("cpu")
        self.dtype = torch.float32

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(1, batch, 1, max_len, 1, torch.float32)

    def forward(self, tokens, positions, cache, attn_mask, logits_from=0, decode=False, feature_layers=()):
        logits = self.table[tokens]  # [B, T, vocab]
        return logits[:, logits_from:], logits

    def forward_parts(self, parts, feature_layers=()):
        return forward_each(self, parts, feature_layers)


class ScriptedDrafter(Drafter):
    """Proposes what `oracle(tokens)` says: the true continuation (always right) or garbage (always wrong)."""

    def __init__(self, oracle) -> None:
        self.oracle = oracle
        self.commits: list[int] = []

    def fork(self) -> ScriptedDrafter:
        return ScriptedDrafter(self.oracle)

    def reset(self) -> None:
        self.commits.clear()

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft.chain(torch.tensor(self.oracle(ctx.tokens, max_tokens), dtype=torch.long))

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        self.commits.append(len(accepted))


def random_chain(vocab: int, seed: int, sharpness: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, vocab, generator=g, dtype=torch.float64) * sharpness).softmax(-1).float()


def l1_bound(num_outcomes: int, num_samples: int, delta: float = 1e-6) -> float:
    """L1 distance an empirical distribution exceeds with probability < delta (Bretagnolle-Huber-Carol)."""
    import math

    return math.sqrt(2 * (num_outcomes * math.log(2) + math.log(1 / delta)) / num_samples)


def assert_exact_distribution(counts: dict[tuple, int], exact: dict[tuple, float]) -> None:
    """The sampled outputs `counts` come from the distribution `exact`: no output outside its support, and an
    empirical L1 distance under the bound it exceeds with probability < 1e-6."""
    total = sum(counts.values())
    assert set(counts) <= set(exact)
    l1 = sum(abs(counts.get(seq, 0) / total - p) for seq, p in exact.items())
    assert l1 < l1_bound(len(exact), total), l1


class ScriptedTreeDrafter(Drafter):
    """Proposes a tree: at each depth a wrong guess first, then the oracle's token as its sibling, the next depth
    under the right one; so greedy must pick the second child every time."""

    def __init__(self, oracle, vocab: int) -> None:
        self.oracle = oracle
        self.vocab = vocab
        self.paths: list[list[int]] = []

    def fork(self) -> ScriptedTreeDrafter:
        return ScriptedTreeDrafter(self.oracle, self.vocab)

    def reset(self) -> None:
        self.paths.clear()

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        right = self.oracle(ctx.tokens, max_tokens // 2)
        tokens, parents, parent = [], [], -1
        for token in right:
            tokens += [(token + 1) % self.vocab, token]
            parents += [parent, parent]
            parent = len(tokens) - 1
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        self.paths.append(list(accepted))


def exact_sequence_probs(chain: torch.Tensor, start: int, length: int, eos: int) -> dict[tuple, float]:
    """Probability of every output (cut after EOS or at `length` tokens) of a Markov chain."""
    out: dict[tuple, float] = {}
    vocab = chain.shape[0]
    for seq in itertools.product(range(vocab), repeat=length):
        if eos in seq:
            seq = seq[: seq.index(eos) + 1]
        prob, prev = 1.0, start
        for tok in seq:
            prob *= float(chain[prev, tok])
            prev = tok
        out[seq] = prob  # sequences cut at EOS repeat; their probability is the same each time
    return out


class Cycling(Drafter):
    """A prototype whose forks are made by each maker in turn: requests of one engine draft differently."""

    def __init__(self, *makers) -> None:
        self.makers = itertools.cycle(makers)

    def fork(self) -> Drafter:
        return next(self.makers)()


DRAFTER_PROMPTS = [[1, 2, 3, 4, 1, 2, 3], list(range(5, 30)), [7, 7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]


def tokens_of(engine, prompt: list[int], params) -> list[int]:
    """Every token an engine generates for one prompt."""
    return [t for step in engine.generate(prompt, params) for t in step.tokens]


def exact_rule_probs(vocab: int, length: int, eos: int, start: int, next_probs) -> dict[tuple, float]:
    """Probability of every output (cut after EOS or at `length` tokens) when the next token after `prev`, with
    `output` emitted so far, is drawn from next_probs(prev, output) -> [vocab] (a penalised or masked chain)."""
    out: dict[tuple, float] = {}
    for seq in itertools.product(range(vocab), repeat=length):
        if eos in seq:
            seq = seq[: seq.index(eos) + 1]
        prob, prev = 1.0, start
        for i, token in enumerate(seq):
            prob *= float(next_probs(prev, list(seq[:i]))[token])
            prev = token
        out[seq] = prob
    return out


def sampled_outputs(engine, prompt: list[int], params, trials: int) -> dict[tuple, int]:
    """How often each output comes out of `trials` runs with seeds 0, 1, ..."""
    counts: dict[tuple, int] = {}
    for seed in range(trials):
        out = tuple(tokens_of(engine, prompt, type(params)(**{**params.__dict__, "seed": seed})))
        counts[out] = counts.get(out, 0) + 1
    return counts
