"""The drafter registry: one dict from method name to drafter class, the only place methods are named."""

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.none import NoDrafter

DRAFTERS: dict[str, type] = {
    "none": NoDrafter,
    "draft": DraftModelDrafter,
    "ngram": NgramDrafter,
}

__all__ = ["DRAFTERS", "Draft", "DraftContext", "Drafter", "DraftModelDrafter", "NgramDrafter", "NoDrafter"]
