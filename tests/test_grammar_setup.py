"""A grammar's setup cost: llguidance's tokenizer tables built straight from the tokenizer's JSON give the very masks
llguidance's own builder gives, and masking never loads torch.compile's machinery (4-5 s of a `--json-schema`
run went there)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import llguidance.hf
import pytest
import torch
from llguidance import LLMatcher
from test_cross_tokenizer import byte_level, sentencepiece_like

from specdecode.rules.grammar import JSON_OPTIONS, GrammarCompiler, fill_mask_row

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "tags": {"type": "array", "items": {"enum": ["a b", "<|end|>", "ünï"]}, "maxItems": 3}},
          "x-guidance": JSON_OPTIONS}


def walk(info, grammar: str, vocab: int, seed: int, steps: int = 40) -> list[tuple[list[int], list[int]]]:
    """Each step's mask (as allowed ids) and forced tokens along one random legal path."""
    rng, matcher, seen = random.Random(seed), LLMatcher(info, grammar), []
    for _ in range(steps):
        bitmask = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
        fill_mask_row(matcher, bitmask, 0)
        allowed = [t for t in range(vocab) if (int(bitmask[0, t // 32]) >> (t % 32)) & 1]
        seen.append((allowed, list(matcher.compute_ff_tokens())))
        if not allowed or matcher.is_stopped():
            break
        assert matcher.consume_token(rng.choice(allowed))
    return seen


@pytest.mark.parametrize("make", [byte_level, sentencepiece_like])
def test_the_tables_built_from_the_tokenizer_json_mask_as_llguidance_own_builder(make):
    tokenizer = make(300)
    eos = (tokenizer.eos_token_id,)
    ours = GrammarCompiler(tokenizer, len(tokenizer), eos).info
    theirs = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=list(eos))
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    for seed in range(4):
        assert walk(ours, grammar, len(tokenizer), seed) == walk(theirs, grammar, len(tokenizer), seed)


def test_a_tokenizer_with_padding_on_still_builds_through_llguidance():
    tokenizer = byte_level(300)
    tokenizer.backend_tokenizer.enable_padding(length=8)
    constraint = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,)).json_schema(SCHEMA)
    assert tokenizer.backend_tokenizer.padding is not None  # the tokenizer itself is left as it was
    logits = torch.zeros(1, len(tokenizer))
    constraint.matcher().mask(logits, [], [], [-1])
    assert torch.isfinite(logits).sum() >= 1


def test_masking_loads_no_torch_compile(tmp_path: Path):
    script = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
import torch
from llguidance import LLMatcher
from test_cross_tokenizer import byte_level
from specdecode.rules.grammar import Constraint, GrammarCompiler
tokenizer = byte_level(300)
compiler = GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))
constraint = compiler.json_schema({{"type": "object"}})  # compiled as requests are: the first-token check too
state = constraint.matcher()
logits = torch.zeros(2, len(tokenizer))
state.mask(logits, [tokenizer.encode("{{", add_special_tokens=False)[0]], [-1], [-1, 0])
assert torch.isfinite(logits[0]).any() and torch.isfinite(logits[1]).any()
print("torch._dynamo" in sys.modules, "llguidance.torch" in sys.modules)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"], done.stdout
