"""The method table: for each `--method`, its drafter factory, its default shape and what `--draft` names for it.
The Python API (api.py), the command-line flags (cli_args.py), the benchmark (bench/), the advisor (advise/) and
the server all read it; it is the only place a method name is mapped to behaviour. A new drafter is one file in
drafters/ and one row here, or, from outside the package, one `register` call before the CLI or the API runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specdecode.atomic_files import recover_folder
from specdecode.drafters import (
    Drafter,
    DraftModelDrafter,
    EagleDrafter,
    HybridDrafter,
    MedusaDrafter,
    NgramDrafter,
    NoDrafter,
    draft_model,
    recycle,
    suffix,
)
from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdecode.drafters.hybrid import NGRAM_BRANCHES
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.drafters.mtp import MtpDrafter, check_mtp_source, ships_mtp
from specdecode.drafters.recycle import RecycleDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.errors import SpecdecodeError
from specdecode.planner.tuning import DRAFT_MIN_CONFIDENCE, DRAFT_WINDOW
from specdecode.weights.loading import Models

SHAPES = ("chain", "tree")


@dataclass(frozen=True)
class Method:
    name: str
    summary: str  # one line for --help and the docs
    # What --draft names: "model" (a draft model, any tokenizer), a head kind ("eagle", "medusa":
    # the folder `specdecode train KIND` wrote), or None (nothing).
    draft: str | None
    default_shape: str  # "chain" or "tree" when --draft-shape is not given
    shaped: bool  # whether --draft-shape changes it (the benchmark can run NAME-chain and NAME-tree side by side)
    build: Callable[[Models, bool, int], Drafter]  # (models, tree?, max_ngram) -> the drafter
    remembers: bool = False  # drafts from earlier answers (Models.suffix_pool, --suffix-pool-mb, --suffix-pool)
    advised: bool = False  # `specdecode advise` measures it by default (with each draft model, where it runs one)
    precheck: Callable[[str], None] | None = None  # the target's source checked before anything loads (may raise)
    # Whether a target runs it, for the lists of methods tried by default (bench, advise); None: every target
    offered: Callable[[str], bool] | None = None

    @property
    def drafts(self) -> bool:
        """False for plain decoding, the baseline (no draft size to choose, no cost curve needed)."""
        return self.name != "none"

    @property
    def needs_draft_model(self) -> bool:
        return self.draft == "model"

    @property
    def head(self) -> str | None:
        """The kind of trained head its --draft folder holds, None for methods without one."""
        return self.draft if self.draft not in (None, "model") else None


def _draft_model(models: Models, tree: bool, max_ngram: int) -> Drafter:
    # A tree feeds only the best node of each depth (TREE_EXPAND): its siblings are leaves that cost no draft
    # forward, only the verify rows the planner finds worth their cost, so where verify rows are cheap they catch
    # some of the chain's misses for free. Measured on the AMX Xeon (BENCHMARKS.md, "Draft trees by default"):
    # `hybrid` 1.48x vs 1.43x `none` as a chain on the dev sets, 1.02x vs 0.97x on other kinds of work; `draft`
    # 1.43x vs 1.41x. Where rows are dear the planner keeps few siblings and the tree drafts as a chain.
    if models.draft_bridge is not None:  # another tokenizer: a greedy chain in its own tokens, mapped as text
        inner = DraftModelDrafter(models.draft, vocab_size=len(models.draft_bridge.draft),
                                  min_confidence=DRAFT_MIN_CONFIDENCE, head_tokens=models.draft_head_tokens)
        return CrossTokenizerDrafter(inner, models.draft_bridge)
    return DraftModelDrafter(models.draft, vocab_size=models.target.config.vocab_size,
                             min_confidence=DRAFT_MIN_CONFIDENCE, width=draft_model.TREE_WIDTH if tree else 1,
                             expand=draft_model.TREE_EXPAND if tree else 1, head_tokens=models.draft_head_tokens,
                             window=DRAFT_WINDOW)


def _eagle(models: Models, tree: bool, max_ngram: int) -> EagleDrafter:
    return EagleDrafter.load(models.trained, models.target, **({} if tree else {"width": 1}))


def _medusa(models: Models, tree: bool, max_ngram: int) -> MedusaDrafter:
    return MedusaDrafter.load(models.trained, models.target, **({} if tree else {"width": 1}))


def _mtp(models: Models, tree: bool, max_ngram: int) -> MtpDrafter:
    if models.source is None:
        raise SpecdecodeError("--method mtp reads the target checkpoint's MTP layers: load the models with "
                              "load_models (its source is not known here)")
    return MtpDrafter.load(models.source, models.target, **({} if tree else {"width": 1}))


def _recycle(models: Models, tree: bool, max_ngram: int) -> RecycleDrafter:
    return RecycleDrafter(models.target.config.vocab_size, width=recycle.TABLE_WIDTH if tree else 1)


def _suffix(models: Models, tree: bool, max_ngram: int) -> SuffixDrafter:
    return SuffixDrafter(models.suffix_pool, branches=suffix.MAX_CONTINUATIONS if tree else 1)


def _hybrid(models: Models, tree: bool, max_ngram: int) -> HybridDrafter:
    # Copiers cost well under a millisecond a step, so all of them look and the best is valued against the model;
    # they draft trees whatever the model's shape, where the target verifies trees. Token recycling is left out:
    # the target's top-k it needs costs every step, and measured it paid less than the suffix pool (BENCHMARKS.md).
    trees = verifies_trees(models)
    return HybridDrafter(_draft_model(models, tree, max_ngram), max_ngram, (_suffix(models, trees, max_ngram),),
                         copy_trees=trees)


def _lookahead(models: Models, tree: bool, max_ngram: int) -> LookaheadDrafter:
    if not verifies_trees(models):  # its window and its pool's n-grams are siblings under the root
        raise SpecdecodeError("--method lookahead needs the native model's tree attention; this architecture runs "
                              "through transformers (use ngram or suffix)")
    return LookaheadDrafter()


def verifies_trees(models: Models) -> bool:
    """Can the target verify a tree (the native model; a transformers model verifies chains)?"""
    from specdecode.models.model import Transformer

    return isinstance(models.target, Transformer)


def _ngram(models: Models, tree: bool, max_ngram: int) -> NgramDrafter:
    return NgramDrafter(max_ngram=max_ngram, branches=NGRAM_BRANCHES if tree else 1)  # siblings cost nothing


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("none", "plain decoding through the same engine: the baseline", None, "chain", False,
           lambda models, tree, max_ngram: NoDrafter(), advised=True),
    Method("draft", "a smaller model drafts every step (one with another tokenizer drafts text, mapped to the "
           "target's tokens)", "model", "tree", True,
           _draft_model, advised=True),
    Method("ngram", "prompt lookup: copies what followed an earlier match of the last tokens", None, "tree", True,
           _ngram, advised=True),
    Method("recycle", "token recycling: the target's own earlier top guesses after each token, grown into a tree",
           None, "tree", True, _recycle),
    Method("lookahead", "lookahead decoding: a Jacobi window rides in the verify forward; the n-grams the target "
           "endorses on it are drafted", None, "tree", False, _lookahead),
    Method("suffix", "suffix decoding: the most frequent continuations of the longest match, in this request and "
           "in earlier answers (a pool shared by the server's requests)", None, "tree", True, _suffix, remembers=True,
           advised=True),
    Method("hybrid", "each step the drafter expected to pay most: prompt lookup, suffix decoding or the draft "
           "model (the default)", "model", "tree", True, _hybrid, remembers=True, advised=True),
    Method("eagle", "a trained EAGLE head over the target's features drafts a tree", "eagle", "tree", True, _eagle),
    Method("medusa", "trained Medusa heads draft a static tree", "medusa", "tree", False, _medusa),
    Method("hybrid-eagle", "prompt lookup where it pays, else a trained EAGLE head", "eagle", "tree", False,
           lambda models, tree, max_ngram: HybridDrafter(_eagle(models, tree, max_ngram), max_ngram)),
    Method("mtp", "the multi-token-prediction layers the checkpoint ships (Qwen3-Next's mtp.*) draft a tree",
           None, "tree", True, _mtp, precheck=check_mtp_source, offered=lambda target: ships_mtp(target) is True),
    Method("hybrid-mtp", "prompt lookup where it pays, else the checkpoint's multi-token-prediction layers", None,
           "tree", False, lambda models, tree, max_ngram: HybridDrafter(_mtp(models, tree, max_ngram), max_ngram),
           precheck=check_mtp_source, offered=lambda target: ships_mtp(target) is True),
)}
DEFAULT_METHOD = "hybrid"


def register(method: Method) -> None:
    """Add a method to the table: a drafter defined outside the package (a plugin, a test). Call it before the
    command-line parsers are built (they list the table's names) or the API loads a decoder."""
    if method.name in METHODS:
        raise SpecdecodeError(f"a method named '{method.name}' exists already")
    METHODS[method.name] = method


def unregister(name: str) -> None:
    """Take a `register`ed method out of the table again."""
    METHODS.pop(name, None)


def heads() -> set[str]:
    """The kinds of trained head some method runs (what a --draft folder of `specdecode train` may hold)."""
    return {m.head for m in METHODS.values() if m.head is not None}


def get_method(name: str) -> Method:
    if name not in METHODS:
        raise SpecdecodeError(f"unknown method '{name}': choose one of {', '.join(METHODS)}")
    return METHODS[name]


def shape_of(name: str, shape: str | None) -> str:
    """The shape `name` drafts: `shape` if given (checked), else the method's default."""
    if shape is None:
        return get_method(name).default_shape
    if shape not in SHAPES:
        raise SpecdecodeError(f"unknown draft shape '{shape}': choose one of {', '.join(SHAPES)}")
    return shape


def build_drafter(name: str, models: Models, shape: str | None = None, max_ngram: int = 3) -> Drafter:
    """The drafter of method `name` over loaded models (a tree needs the native model's tree attention: a
    transformers model verifies chains)."""
    tree = shape_of(name, shape) == "tree" and verifies_trees(models)
    return get_method(name).build(models, tree, max_ngram)


def trained_folder(name: str, draft: str | None) -> str | None:
    """The trained drafter folder a method with a head needs (None for other methods)."""
    head = get_method(name).head
    if head is None:
        return None
    if draft:
        recover_folder(draft)  # a replacement a kill left halfway (atomic_files.py)
    if not draft or not Path(draft).is_dir():
        raise SpecdecodeError(f"--method {name} needs --draft DIR: the folder `specdecode train {head}` wrote"
                              + (f" ('{draft}' is not a folder)" if draft else ""))
    return draft
