"""Drafters: every way of guessing tokens, behind one contract (base.py). Which method runs which drafter is the
method table's to say (specdecode/methods.py)."""

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.none import NoDrafter

__all__ = ["Draft", "DraftContext", "Drafter", "DraftModelDrafter", "EagleDrafter", "HybridDrafter", "MedusaDrafter",
           "NgramDrafter", "NoDrafter"]
