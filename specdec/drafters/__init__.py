"""Drafters: n-gram (prompt lookup), a draft model, Medusa heads, and the :class:`Drafter` base for your own."""

from .base import Drafter
from .draft_model import DraftModelDrafter
from .medusa import MedusaDrafter, MedusaHeads
from .ngram import NGramDrafter
from .oracle import OracleDrafter

__all__ = ["Drafter", "NGramDrafter", "DraftModelDrafter", "MedusaHeads", "MedusaDrafter", "OracleDrafter", "make_drafter"]


#: drafter names of the command line whose drafter needs a model object -> what to pass instead
_NEEDS_OBJECT = {
    "draft_model": "drafter=DraftModelDrafter(draft_model)",
    "medusa": "drafter=MedusaDrafter(heads), heads = MedusaHeads.from_pretrained(path, target=model)",
    "mtp": "a Drafter subclass that runs the model's multi-token-prediction layers",
}


def make_drafter(drafter) -> Drafter:
    """A drafter from ``"ngram"`` or a :class:`Drafter` instance.

    Raises:
        ValueError: an unknown name, or ``"draft_model"`` / ``"medusa"`` / ``"mtp"``, whose
            drafters need an object (the message says which to pass). TypeError: anything else.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        if drafter == "ngram":
            return NGramDrafter()
        if drafter in _NEEDS_OBJECT:
            raise ValueError(f"drafter={drafter!r} needs an object the name alone cannot build: pass "
                             f"{_NEEDS_OBJECT[drafter]} (only 'ngram' works as a name)")
        raise ValueError(
            f"unknown drafter {drafter!r}; use 'ngram' or an instance from specdec.drafters "
            "(NGramDrafter, DraftModelDrafter, MedusaDrafter, or your own Drafter subclass)"
        )
    raise TypeError(
        f"drafter must be 'ngram' or a specdec.drafters.Drafter instance, got {type(drafter).__name__}; "
        "wrap a draft model as specdec.drafters.DraftModelDrafter(model)"
    )
