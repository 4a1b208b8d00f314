"""The drafter registry: one dict from method name to drafter class, the only place methods are named."""

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.medusa import MedusaDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.none import NoDrafter

DRAFTERS: dict[str, type] = {
    "none": NoDrafter,
    "draft": DraftModelDrafter,
    "ngram": NgramDrafter,
    "hybrid": HybridDrafter,  # prompt lookup where the context repeats, the draft model elsewhere
    "eagle": EagleDrafter,  # trained heads: --draft is the folder `specdecode train` wrote
    "medusa": MedusaDrafter,
    "hybrid-eagle": HybridDrafter,  # prompt lookup where the context repeats, the EAGLE head elsewhere
}

__all__ = ["DRAFTERS", "HEAD_KIND", "Draft", "DraftContext", "Drafter", "DraftModelDrafter", "EagleDrafter",
           "HybridDrafter", "MedusaDrafter", "NgramDrafter", "NoDrafter"]
HEAD_KIND = {"eagle": "eagle", "medusa": "medusa", "hybrid-eagle": "eagle"}  # method -> the head its --draft holds
TRAINED = tuple(HEAD_KIND)  # methods whose --draft is a trained head folder (`specdecode train KIND`)
USES_DRAFT_MODEL = ("draft", "hybrid")  # methods whose --draft is a draft model
