"""The benchmark harness behind `specdecode bench` (Spec-Bench style): our methods and transformers' references
on the same model files, dtype and prompts, with a token-by-token losslessness check. See docs/bench.md.

data.py (JSONL -> prompts), loaders.py (models once, one runner per method), runners.py (ours / transformers),
harness.py (warm-up, interleaved timing), metrics.py (aggregates, mismatches), report.py (JSON, markdown),
plots.py (PNG), machine.py (machine info), cli.py (the subcommand).
"""
