"""`specdecode train draft`: LoRA on the draft model through `peft`, distilled toward the target: on the text's
target-written tokens the draft learns the target's own top-k distribution (cross-entropy to it, which is the KL up
to a constant), so it agrees with the target rather than with the data's author. The draft trains in float32 as
transformers builds it (a GGUF de-quantized); the adapter then runs on the draft in whatever form it runs."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from specdecode.errors import SpecdecodeError
from specdecode.training.features import Features
from specdecode.training.loop import optimize, packed_batches
from specdecode.weights import store
from specdecode.weights.loading import LoadPlan, load_model
from specdecode.weights.lora import KIND

LAYERS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH_TOKENS = 512


def train_and_save(args: argparse.Namespace, target: torch.nn.Module, tokenizer, features: Features,
                   plan: LoadPlan, meta: dict) -> dict:
    try:
        import peft
    except ImportError:
        raise SpecdecodeError("`specdecode train draft` needs peft: pip install 'specdecode[train]'") from None
    import transformers

    from specdecode.weights.files import load_checkpoint
    from specdecode.weights.loading import check_same_tokenizer

    ckpt = load_checkpoint(args.draft, torch.float32)
    check_same_tokenizer(tokenizer, ckpt.tokenizer, args.target, args.draft, "a LoRA draft")
    config = transformers.AutoConfig.for_model(**ckpt.config)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(ckpt.state_dict, strict=False)
    model.tie_weights()
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=LAYERS)
    model = peft.get_peft_model(model, lora).to(args.device)
    before = evaluate(model, features, args.device)
    log = train(model, features, args.epochs, args.lr or 2e-4, None if args.time_budget is None
                else args.time_budget * 60, args.seed, args.device)
    report = evaluate(model, features, args.device)
    report["untuned_draft"] = before
    tensors = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            plain = name.removeprefix("base_model.model.")
            tensors[f"{plain}.lora_a"] = module.lora_A["default"].weight.detach().cpu()
            tensors[f"{plain}.lora_b"] = module.lora_B["default"].weight.detach().cpu()
    # Fingerprinted against the draft as the engine loads it (its norms), so a wrong draft is refused.
    draft_native, _ = load_model(args.draft, plan.dtype, args.device, "none", "stored" if ckpt.path.is_file()
                                 and args.device == "cpu" else "float")
    store.save(Path(args.out), KIND, {"rank": args.rank, "alpha": 2 * args.rank, "layers": LAYERS}, tensors,
               draft_native, args.draft, {"distilled_toward": args.target,
                                          "target_fingerprint_of_teacher": store.target_fingerprint(target),
                                          "training": {**meta, **log}, "report": report})
    if args.merge:
        merged = model.merge_and_unload()
        merged.save_pretrained(args.merge, safe_serialization=True)
        ckpt.tokenizer.save_pretrained(args.merge)
        print(f"merged draft written to {args.merge} (use it as --draft {args.merge})")
    return report


def _loss(model, features: Features, group: list[tuple[int, int]], device: str) -> tuple[torch.Tensor, int, int]:
    """Cross-entropy of the draft to the target's top-k on one packed group -> (loss, agreeing, counted)."""
    total, right, counted = 0.0, 0, 0
    for a, b in group:  # one sequence at a time: no attention across them
        ids = features.tokens[a:b].to(device)
        logits = model(input_ids=ids[None]).logits[0, :-1].float()  # row i predicts token i + 1
        loss_rows = features.loss[a + 1 : b].nonzero().squeeze(-1)
        if loss_rows.numel() == 0:
            continue
        top_ids = features.top_ids[a:b - 1][loss_rows].to(device)
        p = features.top_logprobs[a:b - 1][loss_rows].to(device).exp()
        p = p / p.sum(-1, keepdim=True)
        logq = logits[loss_rows].log_softmax(-1)
        total = total + -(p * logq.gather(1, top_ids)).sum()
        right += int((logq.argmax(-1) == top_ids[:, 0]).sum())
        counted += loss_rows.numel()
    return total / max(counted, 1), right, counted


def train(model, features: Features, epochs: float, lr: float, seconds: float | None, seed: int,
          device: str) -> dict:
    def step(group: list[tuple[int, int]]):
        loss, right, counted = _loss(model, features, group, device)
        return loss, [(right, counted)]

    return optimize(model, features, step, epochs=epochs, lr=lr, seconds=seconds, seed=seed, positions=1,
                    desc="train draft (LoRA)", batch_tokens=BATCH_TOKENS, warmup=10)


@torch.no_grad()
def evaluate(model, features: Features, device: str) -> dict:
    """Top-1 agreement with the target on the held-back split's target-written tokens: the chance a one-token
    draft is accepted under greedy decoding."""
    right = counted = 0
    for group in packed_batches(features.sequences(held=True), None, BATCH_TOKENS):
        _, r, c = _loss(model, features, group, device)
        right, counted = right + r, counted + c
    rate = right / max(counted, 1)
    return {"acceptance_per_position": [round(rate, 4)], "top1_agreement": round(rate, 4), "rows": counted,
            "mean_accepted_length": round(1 + sum(rate**k for k in range(1, 6)), 3)}
