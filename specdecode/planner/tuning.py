"""Every tuned constant of speculation's cost decisions, each with where its value came from (sections of the
benchmark history, docs/benchmarks/, in quotes; "not swept": a reasoned value no run has tested against others).
"""

MAX_AUTO_NODES = 16  # the most nodes an automatic size verifies: the end of the measured cost curve (budget.py)
# A seeded sampled request served beside others gets this fixed size instead of an automatic one, which follows
# load and timing and would change its draws: the pre-cost-curve default k ("Draft length default").
SEEDED_NUM_DRAFT_TOKENS = 4
# A request with a prediction under a method that never drafts (no cost curve measured) copies this many (not swept).
PREDICTION_DRAFT_TOKENS = 8
DRAFT_MIN_CONFIDENCE = 0.5  # fixed size: a draft model stops below this top probability ("Draft length default")
HEAD_MIN_CONFIDENCE = 0.3  # the same for an EAGLE head, lower: its 2nd-3rd guesses are often right (docs/train.md)
# The most prompt tokens a draft model reads (its first few and the newest). It reads a prompt at about a third of
# the target's prefill cost, which a short answer does not pay back: on RAG and summary prompts of 400-560 tokens
# `hybrid` went from 0.90x `none` with the whole prompt to 0.94x with 256 and 1.01x with 128, and 0.96-0.98x with
# 64 or 32 (the draft guesses worse); the dev sets 1.21x -> 1.24x with 128 ("A window on the draft's prompt").
DRAFT_WINDOW = 128
COPY_MIN_SCORE = 0.5  # hybrid, fixed size: copy when the first copied token is at least an even bet (not swept)
# P(a draft model's next guess is accepted | the guess it follows was), for one more draft forward's worth:
# 0.83 measured on the dev sets; weighing the best child at 0.8 instead of as a sure thing cut the drafted tokens
# that lose on other kinds of work (1.17x vs 1.11x `none`; on unused prompts of those kinds 1.15x vs 1.06x), and
# was level to 2.7% ahead on the dev sets; 0.6 cut good drafts there (1.32x vs 1.41x) ("Draft trees by default").
FOLLOW = 0.8
# A model drafter's confidence in a node given its parent, against how often the target accepted such nodes in this
# request (drafters/tree_growth.py, DepthTrust), kept apart for the first depth and the deeper ones: on the dev
# sets both matched, on translation and answers from a passage the deeper ones promised more than they gave
# ("Believing the draft model's scores"). A step's evidence weighs MODEL_TRUST_DECAY less after each later step,
# and MODEL_TRUST_PRIOR tokens of "as promised" always stay, so a depth that stopped being drafted drifts back to
# being believed and is tried again. Held to MODEL_TRUST_RANGE: a few lucky steps cannot make it draft without limit.
MODEL_TRUST_DECAY = 0.9
MODEL_TRUST_PRIOR = 1.0
MODEL_TRUST_RANGE = (0.3, 1.25)
PRIOR_SPEEDUP = 1.3  # hybrid: the model's value before its first step, x a one-token forward's rate ("Hybrid drafter")
RECORD_WEIGHT = 0.25  # hybrid: a step's weight in the model's running record ("Hybrid drafter"; not swept)
FORWARD_WEIGHT = 0.2  # a forward's weight in a drafter's running seconds per forward (not swept)
CHEAP_DRAFT = 0.02  # a drafter under this share of a step always proposes: n-gram, ~0.1 of ~25 ms ("Batched serving")
CATCH_UP_STEPS = 8  # a draft model's catching up is paid back over at most this many steps ("Batched serving")
PRIOR_GAIN = 2.0  # accepted tokens per drafted step before any is measured: the dev sets' 2-3 ("Hybrid drafter")
PRIOR_WEIGHT = 4.0  # drafted steps the engine-wide gain weighs beside a request's own ("Batched serving"; not swept)
PRIOR_NODES = 4.0  # nodes per drafted step before any is measured: the old fixed k ("Draft length default")
OWN_WEIGHT = 0.3  # a step's weight in a request's own running estimates ("Batched serving"; not swept)
SHARED_WEIGHT = 0.1  # a step's weight in the engine-wide estimates ("Batched serving"; not swept)
# A request kept from drafting retries after this many steps, only in batches this small: in larger ones a draft
# model's retry and catch-up cost everyone ("Batched serving": retries cost 15% in small per-replica batches).
EXPLORE_EVERY = 16
EXPLORE_BATCH = 2
# hybrid: how far a copier's scores are believed in a request (drafters/hybrid.py): the tokens its verified drafts
# gave over those their scores promised, recent steps weighing more; as promised before it drafts (not swept).
COPY_TRUST_DECAY = 0.8
COPY_TRUST_PRIOR = 1.0
# prompt lookup: its running acceptance rate starts as 1 accepted out of 2 tried (not swept)
NGRAM_PRIOR_RATE, NGRAM_PRIOR_WEIGHT = 0.5, 2.0
# lookahead: pool tokens accepted per window row fed, before any is measured, and the past's weight in its running
# sums (not swept)
LOOKAHEAD_PRIOR_YIELD, LOOKAHEAD_YIELD_WEIGHT = 0.1, 8.0
LOOKAHEAD_DECAY = 0.95
# Predicted Outputs (drafters/prediction.py): off the prediction, a draft model drafts only when its catching up on
# the copied tokens costs at most this many one-row target forwards, and is tried again after this many plain
# steps (not swept).
PREDICTION_CATCH_UP_MAX = 1.0
PREDICTION_RETRY_AFTER = 8
# Chunked prefill (planner/prefill.py): beside decoding requests a prompt gets the smallest chunk that feeds it at
# (1 - PREFILL_OVERHEAD) of its rate alone, at least PREFILL_ROWS_MIN rows; PREFILL_ROWS_BUSY until a step is timed
# or priced; nobody decoding, PREFILL_ROWS_IDLE (the most a step takes); a request that wants every row's logits
# (prompt logprobs) PREFILL_ROWS_ECHO. Prices follow the steps' times (weight PREFILL_ROW_WEIGHT). At 0.2 the
# 2-core Zen 4 lands near the 64 rows that served 4k prompts best there ("Long prompts under load": steps stretched
# with the wait lost at the median); 64 rows had been the fixed size. Not swept beyond that.
PREFILL_ROWS_BUSY = 64
PREFILL_ROWS_IDLE = 512
PREFILL_ROWS_ECHO = 64
PREFILL_ROWS_MIN = 16
PREFILL_OVERHEAD = 0.2
PREFILL_ROW_WEIGHT = 0.3
# A request decoding alone (planner/alone.py): judged on its last drafted steps (each step's evidence weighs
# ALONE_DECAY less after each later one), once it has ALONE_MIN_STEPS of them; it decodes plainly for
# ALONE_BENCH_STEPS steps (doubling to ALONE_BENCH_MAX after each retry that loses too) when its drafted steps make
# fewer than ALONE_MARGIN times its plain steps' tokens per second. With 0.8 and 0.95 it benched a dev-set answer
# drafting at 1.32x `none` for 16 steps (1.17x); 0.9 and 0.9 judge on ~10 steps and a clear loss ("Long prompts").
ALONE_DECAY = 0.9
ALONE_MIN_STEPS = 8
ALONE_MARGIN = 0.9
ALONE_BENCH_STEPS = 8
ALONE_BENCH_MAX = 64
