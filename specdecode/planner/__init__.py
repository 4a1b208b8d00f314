"""Every cost decision of speculation: the verify cost curve (budget.py), what one request's draft may cost
(prices.py), the engine's per-step decisions over plain request records (planner.py), the one running estimator
they share (estimates.py) and every tuned constant with where its value came from (tuning.py)."""
