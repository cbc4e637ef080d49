"""Drafters: n-gram (prompt lookup), a draft model, Medusa heads, and the :class:`Drafter` base for your own."""

from .base import Drafter
from .draft_model import DraftModelDrafter
from .medusa import MedusaDrafter, MedusaHeads
from .ngram import NGramDrafter
from .oracle import OracleDrafter

__all__ = ["Drafter", "NGramDrafter", "DraftModelDrafter", "MedusaHeads", "MedusaDrafter", "OracleDrafter", "make_drafter"]


def make_drafter(drafter) -> Drafter:
    """A drafter from ``"ngram"`` or a :class:`Drafter` instance.

    Raises:
        ValueError: unknown name. TypeError: anything else.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        if drafter == "ngram":
            return NGramDrafter()
        raise ValueError(
            f"unknown drafter {drafter!r}; use 'ngram' or an instance from specdec.drafters "
            "(NGramDrafter, DraftModelDrafter, MedusaDrafter, or your own Drafter subclass)"
        )
    raise TypeError(
        f"drafter must be 'ngram' or a specdec.drafters.Drafter instance, got {type(drafter).__name__}; "
        "wrap a draft model as specdec.drafters.DraftModelDrafter(model)"
    )
