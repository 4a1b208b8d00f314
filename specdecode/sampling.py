"""Logits -> the distribution actually sampled, and sampling from it (on GPUs without a host sync).

The target distribution of a request is defined *after* temperature, top-k and top-p. Speculative sampling is
lossless with respect to that distribution only if the draft distribution goes through the very same transform,
so both sides call `to_probs` with the same `SamplingParams`.
"""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams
from specdecode.kernels import cpu_kernels


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] logits -> each row's argmax, the first index on ties: `logits.argmax(-1)`, on the native
    kernel for CPU float32 (torch's takes ~0.24 ms for six rows of a 152k vocabulary, every greedy step)."""
    if logits.dim() == 2 and logits.dtype == torch.float32 and logits.is_cpu and logits.is_contiguous():
        if (kernels := cpu_kernels()) is not None:
            tokens = kernels.argmax_rows(logits)
            if int(tokens.min()) >= 0:  # -1: a row with a NaN, which torch counts as the largest
                return tokens
    return logits.argmax(-1)


def greedy_top1(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] logits -> (each row's argmax [rows, 1], its softmax probability [rows, 1]): a greedy chain
    drafter's child and confidence, without a softmax over the whole row (on the native kernel for CPU float32)."""
    logits = float32_rows(logits)
    if (kernels := topk_kernels(logits, 1)) is not None:
        index, prob, answered = kernels.top1_probs(logits)
        if answered:
            return index[:, None], prob[:, None]
    top_probs, top_index = logits.softmax(-1).topk(1, dim=-1)
    return top_index, top_probs


def greedy_topk(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, vocab] logits -> (each row's k likeliest tokens [rows, k], likeliest first, and their softmax
    probabilities [rows, k]): a greedy tree drafter's children and confidences, without a softmax over the whole
    row (on the native kernel for CPU float32: ~4x cheaper than torch's softmax and topk on a 32k head)."""
    logits = float32_rows(logits)
    if k == 1:
        return greedy_top1(logits)
    if (kernels := topk_kernels(logits, k)) is not None:
        index, prob, answered = kernels.topk_probs(logits, k)
        if answered:  # no tensor operation to check: each costs ~10 us on the caches a forward flushed
            return index, prob
    top_probs, top_index = logits.softmax(-1).topk(k, dim=-1)
    return top_index, top_probs


def greedy_topk_lists(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """greedy_topk as rows of lists, what a tree drafter reads: on the native kernel straight into lists (no
    tensors made and read back between two forwards), else greedy_topk's tensors turned into lists (a row the
    kernel cannot rank, which torch answers)."""
    logits = float32_rows(logits)
    if (kernels := topk_kernels(logits, k)) is not None:
        index, prob, answered = kernels.topk_lists(logits, k)
        if answered:
            return index, prob
    index, prob = greedy_topk(logits, k)
    return index.tolist(), prob.tolist()


def topk_kernels(logits: torch.Tensor, k: int):
    """The native kernels where their top-k ranks these float32 rows [rows, vocab] (on the CPU, k at most the
    vocabulary), else None."""
    return cpu_kernels() if logits.dim() == 2 and logits.is_cpu and k <= logits.shape[-1] else None


def float32_rows(logits: torch.Tensor) -> torch.Tensor:
    """`logits` as contiguous float32, converted only where it is not (a no-op `.float()` or `.contiguous()` still
    goes through the dispatcher: ~5-10 us each on the caches a forward flushed)."""
    if logits.dtype != torch.float32:
        logits = logits.float()
    return logits if logits.is_contiguous() else logits.contiguous()


def to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float32 probabilities (greedy: one-hot at the argmax). Temperature, then
    min-p, top-k and top-p. Temperature and top-p alone run on the native kernel on the CPU (the same distribution;
    its last bits may differ from torch's softmax, and the draft and the target both come here)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    if (params.top_p < 1.0 and not params.top_k and params.min_p <= 0 and logits.is_cpu
            and (kernels := cpu_kernels()) is not None):  # ~0.1 ms a row of 152k against ~1.1-2 ms in torch
        rows = logits.reshape(-1, logits.shape[-1]).contiguous()
        probs = kernels.nucleus_probs(rows, params.temperature, params.top_p)
        if probs.numel():  # empty: a row with a NaN or nothing above -inf, which torch's path handles
            return probs.view(logits.shape)
    logits = logits / params.temperature
    if params.min_p > 0:  # after temperature, before top-k and top-p (vLLM's order)
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_outside_nucleus(logits, params.top_p), float("-inf"))
    return logits.softmax(-1)


NUCLEUS_GUESSES = (256, 4096)  # top-p looks for its nucleus among this many likeliest tokens: a full sort costs ~10 ms


def _outside_nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[..., vocab] logits -> True where top-p drops the token: when the tokens ranked above it already reach
    top_p (the top token always stays). On the CPU each row is ranked among its likeliest NUCLEUS_GUESSES[0]
    tokens if those reach top_p (the same ranking a full sort gives them), else among more, else by a full sort."""
    probs = logits.softmax(-1).reshape(-1, logits.shape[-1])  # [rows, vocab]
    keep = torch.zeros_like(probs, dtype=torch.bool)
    todo = torch.arange(probs.shape[0], device=probs.device)
    for k in NUCLEUS_GUESSES if probs.device.type == "cpu" else ():  # a GPU sorts fast; guessing would sync
        if k >= probs.shape[-1] or todo.numel() == 0:
            break
        top_probs, order = probs[todo].topk(k, dim=-1)  # sorted, likeliest first
        reached = top_probs.sum(-1) >= top_p
        keep[todo[reached]] = _nucleus(top_probs[reached], order[reached], probs.shape[-1], top_p)
        todo = todo[~reached]
    if todo.numel():
        keep[todo] = _nucleus(*probs[todo].sort(dim=-1, descending=True), probs.shape[-1], top_p)
    return ~keep.view(logits.shape)


def _nucleus(ranked: torch.Tensor, order: torch.Tensor, vocab: int, top_p: float) -> torch.Tensor:
    """Rows of probabilities ranked likeliest first (and their token ids) -> [rows, vocab] True for the tokens in
    the nucleus: those with less than top_p of mass ranked above them."""
    inside = ranked.cumsum(-1) - ranked < top_p
    return torch.zeros(ranked.shape[0], vocab, dtype=torch.bool, device=ranked.device).scatter_(-1, order, inside)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of [..., vocab] probabilities (any non-negative weights) -> [...] int64.

    On the CPU: inverse CDF over the weights above zero in index order, one uniform draw per row (the native kernel;
    torch's path orders them by a top-k where the kernels are missing). Elsewhere:
    an exponential race, argmax(p / E) with E ~ Exp(1), which needs no host sync. Both pick index i with
    probability p_i / sum(p), driven by the request's own generator.
    """
    if probs.device.type == "cpu":
        rows = probs.reshape(-1, probs.shape[-1])
        if rows.dtype == torch.float32 and rows.shape[0] and (kernels := cpu_kernels()) is not None:
            u = torch.rand(rows.shape[0], generator=generator, dtype=torch.float64)
            tokens = kernels.draw_rows(rows.contiguous(), u)  # the tokens above zero only: ~0.05 ms against ~1
            if int(tokens.min()) >= 0:  # -1: a row without weight, which the torch path below handles
                return tokens.view(probs.shape[:-1])
        return _inverse_cdf(probs, generator)
    race = torch.empty_like(probs).exponential_(generator=generator)
    race.clamp_min_(torch.finfo(race.dtype).tiny)  # a zero draw would turn p=0 into 0/0
    return (probs / race).argmax(-1)


def _inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    # After top-k / top-p few tokens keep any probability: the running sum goes over those (any order will do)
    width = int((rows > 0).sum(-1).max()) if rows.numel() else 0
    weights, ids = rows.topk(width, dim=-1, sorted=False) if 0 < width <= vocab // 8 else (rows, None)
    cdf = weights.double().cumsum(-1)
    u = torch.rand(cdf.shape[0], 1, generator=generator, dtype=torch.float64) * cdf[:, -1:]
    # entry i owns [cdf[i - 1], cdf[i]): right=True finds it, and an entry of zero owns nothing
    pos = torch.searchsorted(cdf, u, right=True).clamp_max_(cdf.shape[-1] - 1)
    stray = weights.gather(-1, pos) <= 0  # u rounded up to the total, which belongs to the last entry above zero
    if bool(stray.any()):
        last = cdf.shape[-1] - 1 - (weights.flip(-1) > 0).to(torch.uint8).argmax(-1, keepdim=True)
        pos = torch.where(stray, last, pos)
    token = pos if ids is None else ids.gather(-1, pos)
    return token.view(probs.shape[:-1])


def gumbel_topk(probs: torch.Tensor, k: int, generator: torch.Generator | None) -> torch.Tensor:
    """[rows, vocab] probabilities -> k tokens a row drawn without replacement, in draw order [rows, k]: the k
    largest log p + Gumbel noise (Gumbel top-k). The noise is drawn for the tokens above zero only (after top-p a
    few; the others never win), so a row of 152k costs a few draws, not 152k. A row with fewer than k such tokens
    ends with tokens of probability zero."""
    k = min(k, probs.shape[-1])
    rows = []
    for row in probs:
        support = row.nonzero().flatten()  # [s]
        noise = torch.empty(support.numel(), dtype=row.dtype, device=row.device).exponential_(generator=generator)
        drawn = support[(row[support].log() - noise.log()).topk(min(k, support.numel())).indices]
        if drawn.numel() < k:
            drawn = torch.cat((drawn, (row == 0).nonzero().flatten()[: k - drawn.numel()]))
        rows.append(drawn)
    return torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.long, device=probs.device)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
