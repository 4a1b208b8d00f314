"""The planner: the node count that pays best, the tree-growth and copy decisions, and sizes per request."""

import pytest

from specdecode.config import SamplingParams
from specdecode.planner.budget import CostCurve, InUseCurve
from specdecode.planner.planner import Planner
from specdecode.planner.prices import FIXED, Record, StepPlan, best_count
from specdecode.planner.tuning import SEEDED_NUM_DRAFT_TOKENS


def test_fast_one_token_forwards_do_not_talk_the_chooser_out_of_drafting():
    curve = CostCurve((1.0, 1.2, 1.4, 1.6))
    scores = [0.5, 0.3]
    assert best_count(curve, scores) == 2
    in_use = InUseCurve(curve)
    for seconds in (0.9, 0.8, 0.7, 0.6, 0.6, 0.6):  # ever faster undrafted steps, as a machine's quiet spells give
        curve = in_use.observe(1, seconds)
    assert curve.ratios() == pytest.approx([1.0, 1.2, 1.4, 1.6])  # the measured shape is kept
    assert best_count(curve, scores) == 2


def test_a_curve_measured_on_a_busy_machine_does_not_stop_drafting_for_good():
    planner = Planner(CostCurve((1.0, 2.5, 3.5, 4.5)))  # measured under load: no draft pays
    assert best_count(planner.costs, [0.6]) == 0
    for _ in range(4):  # so every step decodes one row, and that is all the engine times
        planner.observe(1, 1.0)
    assert best_count(planner.costs, [0.6]) == 1  # a likely first draft token is verified, and two rows timed


def test_verify_forwards_dearer_in_use_than_measured_shrink_the_draft():
    measured = CostCurve((1.0, 1.05, 1.1, 1.15))  # a quiet moment's curve: nodes look nearly free
    scores = [0.5, 0.3, 0.2]
    assert best_count(measured, scores) == 3
    in_use = InUseCurve(measured)
    for _ in range(4):  # in use, every extra row costs 0.4 of a forward
        for m, seconds in ((1, 1.0), (2, 1.4), (3, 1.8), (4, 2.2)):
            curve = in_use.observe(m, seconds)
    assert best_count(curve, scores) == 1


def test_best_count_trades_expected_tokens_against_cost():
    flat = CostCurve(tuple([1.0] * 16))  # a GPU-like curve: every node is free, keep them all
    assert best_count(flat, [0.9, 0.5, 0.1, 0.01]) == 4
    steep = CostCurve(tuple(1.0 + 0.5 * m for m in range(16)))  # each node costs half a forward
    assert best_count(steep, [0.9, 0.8, 0.3]) == 2  # (1 + 1.7) / 2.0 beats (1 + 2.0) / 2.5
    assert best_count(steep, [0.9, 0.8, 0.3], draft_seconds=10.0) == 3  # drafting dominates: verify them all
    assert best_count(steep, []) == 0


def test_a_tree_grows_while_one_more_forward_pays():
    steep = StepPlan(CostCurve(tuple(1.0 + 0.5 * m for m in range(16))))
    # A sure best child and a draft forward at a tenth of the target's: worth it; at ten times, not.
    assert steep.grow([0.9], 0.9, 0.9, spent=0.1, forward_s=0.1, min_confidence=0.5, max_tokens=8)
    assert not steep.grow([0.9], 0.9, 0.9, spent=0.1, forward_s=10.0, min_confidence=0.5, max_tokens=8)
    # In a batch the other requests' rows make each extra row dearer on a CPU-like slope.
    crowded = StepPlan(steep.costs, others_tokens=15.0, others_rows=15)
    assert not crowded.grow([0.3], 0.3, 0.3, spent=0.1, forward_s=0.3, min_confidence=0.5, max_tokens=8)
    # A fixed size grows while the drafter is sure of its newest best guess.
    assert FIXED.grow([0.9], 0.2, 0.6, 0.0, 0.0, min_confidence=0.5, max_tokens=8)
    assert not FIXED.grow([0.9], 0.2, 0.4, 0.0, 0.0, min_confidence=0.5, max_tokens=8)


def test_copy_is_taken_when_it_beats_the_models_record():
    plan = StepPlan(CostCurve((1.0, 1.1, 1.2, 1.3)))
    sure = [0.9, 0.8, 0.7]
    assert plan.copy_pays(sure, 8, Record())  # before the model's first step: worth more than its prior
    model = Record()
    model.add(tokens=3.0, seconds=1.5)  # the model made 3 tokens in a 1.5 s step: 2 a second
    assert not plan.copy_pays([0.3], 8, model)
    assert plan.copy_pays(sure, 8, model)
    assert FIXED.copy_pays([0.6], 8, model) and not FIXED.copy_pays([0.4], 8, model)


def test_sizes_a_request_gets():
    planner = Planner(None)
    assert planner.draft_size(None, 3) == 3 and planner.draft_size(5, None) == 5
    with pytest.raises(Exception, match="cost curve"):
        planner.draft_size(None, None)
    seeded = SamplingParams(temperature=0.7, seed=1)
    assert Planner.served_size(None, None, seeded) == SEEDED_NUM_DRAFT_TOKENS  # reproducible beside other requests
    assert Planner.served_size(2, None, seeded) == 2
    assert Planner.served_size(None, None, SamplingParams(seed=1)) is None  # greedy: automatic stays


def test_a_record_beats_plain_decoding_when_its_tokens_come_faster_than_one_a_forward():
    plan = StepPlan(CostCurve((1.0, 1.1, 1.2, 1.3)))
    assert plan.beats_plain(Record()) and FIXED.beats_plain(Record())  # no record, or no curve: draft
    slow, fast = Record(), Record()
    slow.add(tokens=1.1, seconds=1.2)
    fast.add(tokens=2.0, seconds=1.3)
    assert not plan.beats_plain(slow) and plan.beats_plain(fast)



def test_a_model_drafters_trust_learns_each_depths_acceptance_in_the_request():
    from specdecode.drafters.tree_growth import DepthTrust, Node
    from specdecode.planner.tuning import FOLLOW, MODEL_TRUST_RANGE

    trust = DepthTrust()
    assert trust.factor(1) == trust.factor(4) == 1.0 and trust.follow(1) == FOLLOW  # before any step: as scored
    # A chain of confidences 0.8, 0.75, 0.7: its first node accepted 4 times in 5, the second never.
    chain = [Node(7, i - 1, i + 1, p, 0.0, 0, []) for i, p in enumerate((0.8, 0.75, 0.7))]
    for step in range(40):
        trust.add(chain, [0, 1, 2], {0} if step % 5 else set())
    assert trust.factor(1) == pytest.approx(1.0, abs=0.1)
    assert trust.factor(2) == trust.factor(5) == MODEL_TRUST_RANGE[0]  # held to its range, never nothing
    assert trust.follow(1) < FOLLOW / 2  # one more forward after the first depth is worth little here
    # Only nodes whose parent was accepted count: the third node, behind the rejected second, is not blamed.
    blamed = DepthTrust()
    blamed.add(chain, [0, 1, 2], {0})
    assert blamed.promised[1] == pytest.approx(0.75)
    # A depth no longer drafted drifts back to being believed, and is tried again.
    for _ in range(60):
        trust.add(chain[:1], [0], {0})
    assert trust.factor(2) > 0.9


def test_a_drafts_scores_follow_its_trust_and_never_rise_above_a_parents():
    from tiny import tiny_native

    from specdecode.drafters.base import DraftContext
    from specdecode.drafters.draft_model import DraftModelDrafter

    model = tiny_native("qwen2", seed=3)
    drafter = DraftModelDrafter(model, vocab_size=model.config.vocab_size, width=2, max_depth=3)
    ctx = DraftContext([1, 2, 3, 4], SamplingParams(), None)

    def scores_and_expected(drafter):
        draft = drafter.propose(ctx, 8)
        kept = [drafter.nodes[i] for i in drafter.kept]
        expected = []
        for node in kept:  # the product along the path of each confidence times the trust at its depth
            parent = drafter.kept.index(node.parent) if node.parent >= 0 else -1
            edge = min(1.0, node.prob * drafter.trust.factor(node.depth))
            expected.append(edge * (expected[parent] if parent >= 0 else 1.0))
        assert draft.scores == pytest.approx(expected)
        parents = draft.parents.tolist()
        assert all(p < 0 or draft.scores[i] <= draft.scores[p] for i, p in enumerate(parents))
        return draft, kept

    before, kept = scores_and_expected(drafter)
    assert before.scores[0] == kept[0].prob and any(n.depth > 1 for n in kept)  # believed as scored
    drafter = drafter.fork()  # the same model, a request of its own
    first, deeper = drafter.trust.rates  # accepted (hits) over promised (tried)
    first.hits, first.tried = 4.0, 4.0  # the first depth always right, the deeper ones overrated
    deeper.hits, deeper.tried = 0.0, 2.0
    after, _ = scores_and_expected(drafter)
    assert after.scores[0] == before.scores[0] and min(after.scores) < min(before.scores)


# --- a request decoding alone -----------------------------------------------------------------------------------


def lone_steps(planner: Planner, steps: int, drafted_tokens: int, drafted_s: float, plain_s: float) -> list[bool]:
    """Steps of one automatic request decoding alone: a drafted step emits `drafted_tokens` in `drafted_s`
    (drafting, then a forward over 4 rows of 1.3 s), a plain one 1 token in `plain_s`. -> whether it drafted,
    step by step."""
    from specdecode.planner.planner import Request

    key, took = 1, []
    planner.join(key)
    for _ in range(steps):
        before = Request(key, True, False, None, 0, 0.0, False, 0, 0, 100)
        drafts = key in planner.choose([before], prefill_rows=0)
        took.append(drafts)
        draft_s = drafted_s - 1.3 if drafts else 0.0
        planner.observe(1 + 3 * drafts, 1.3 if drafts else plain_s)
        after = Request(key, True, drafts, [0.5] * 3 if drafts else None, 3 * drafts, draft_s, False, 0, 0, 100)
        planner.learn(after, drafted_tokens - 1 if drafts else 0)
    return took


def test_a_lone_request_drafts_while_its_drafted_steps_beat_its_plain_ones():
    from specdecode.planner.tuning import ALONE_MIN_STEPS

    curve = CostCurve(tuple(1.0 + 0.1 * m for m in range(16)))  # 4 rows: 1.3 s
    # 2 tokens in 1.5 s against 1 in 1 s: drafting pays, it never stops
    assert all(lone_steps(Planner(curve), 40, 2, 1.5, 1.0))
    # 1 token in 1.5 s: it stops after its first judged steps, waits, retries, and waits twice as long
    took = lone_steps(Planner(curve), 60, 1, 1.5, 1.0)
    assert all(took[:ALONE_MIN_STEPS]) and not took[ALONE_MIN_STEPS]
    assert 0.2 < sum(took) / len(took) < 0.5
    runs = [len(run) for run in "".join("d" if t else "p" for t in took).split("d") if run]
    assert runs[1] == 2 * runs[0]  # the wait doubles after a retry that loses too


def test_a_lone_request_is_judged_on_the_forwards_it_timed_only():
    """Where forwards are not timed (CUDA), a lone request drafts every step, as before."""
    from specdecode.planner.planner import Request

    planner = Planner(CostCurve(tuple(1.0 + 0.1 * m for m in range(16))))
    planner.join(1)
    for _ in range(30):
        assert planner.choose([Request(1, True, False, None, 0, 0.0, False, 0, 0, 100)], 0) == {1}
        planner.learn(Request(1, True, True, [0.1], 1, 5.0, False, 0, 0, 100), 0)
