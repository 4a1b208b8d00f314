"""No drafter: the engine then runs plain autoregressive decoding, the baseline every speedup is measured on."""

from __future__ import annotations

from specdecode.drafters.base import Draft, DraftContext, Drafter


class NoDrafter(Drafter):
    name = "none"

    def fork(self) -> NoDrafter:
        return NoDrafter()

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return Draft.empty()
