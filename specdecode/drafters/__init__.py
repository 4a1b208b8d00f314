"""The drafter registry: one dict from method name to drafter class, the only place methods are named."""

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.none import NoDrafter

DRAFTERS: dict[str, type] = {
    "none": NoDrafter,
    "draft": DraftModelDrafter,
    "ngram": NgramDrafter,
    "eagle": EagleDrafter,  # trained heads: --draft is the folder `specdecode train` wrote
    "medusa": MedusaDrafter,
}

__all__ = ["DRAFTERS", "Draft", "DraftContext", "Drafter", "DraftModelDrafter", "EagleDrafter", "MedusaDrafter",
           "NgramDrafter", "NoDrafter"]
TRAINED = ("eagle", "medusa")  # methods whose --draft is a trained head folder
