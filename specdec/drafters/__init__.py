"""Drafters: n-gram (prompt lookup), a draft model, Medusa heads, the target's own MTP layers,
and the :class:`Drafter` base for your own."""

from .base import Drafter
from .draft_model import DraftModelDrafter
from .medusa import MedusaDrafter, MedusaHeads
from .mtp import MTPDrafter, frequent_token_ids
from .ngram import NGramDrafter
from .oracle import OracleDrafter

__all__ = ["Drafter", "NGramDrafter", "DraftModelDrafter", "MedusaHeads", "MedusaDrafter", "MTPDrafter",
           "OracleDrafter", "frequent_token_ids", "make_drafter"]

#: drafter names :func:`make_drafter` takes
DRAFTER_NAMES = ("ngram", "mtp")
#: drafter names of the command line whose drafter needs a model object -> what to pass instead
_NEEDS_OBJECT = {
    "draft_model": "drafter=DraftModelDrafter(draft_model)",
    "medusa": "drafter=MedusaDrafter(heads), heads = MedusaHeads.from_pretrained(path, target=model)",
}


def make_drafter(drafter, target=None) -> Drafter:
    """A drafter from a name or a :class:`Drafter` instance: ``"ngram"`` (prompt lookup) or
    ``"mtp"`` (the MTP layers of the checkpoint ``target`` was loaded from,
    :meth:`MTPDrafter.for_model`; needs ``target``).

    Raises:
        ValueError: an unknown name; ``"mtp"`` without a target or without MTP layers in its
            checkpoint; ``"draft_model"`` / ``"medusa"``, whose drafters need an object (the
            message says which to pass). TypeError: anything else.
    """
    if isinstance(drafter, Drafter):
        return drafter
    if isinstance(drafter, str):
        if drafter == "ngram":
            return NGramDrafter()
        if drafter == "mtp":
            if target is None:
                raise ValueError("drafter='mtp' drafts with the target's own MTP layers: pass the target "
                                 "(make_drafter('mtp', target=model)) or use specdec.wrap(model, drafter='mtp')")
            return MTPDrafter.for_model(target)
        if drafter in _NEEDS_OBJECT:
            raise ValueError(f"drafter={drafter!r} needs an object the name alone cannot build: pass "
                             f"{_NEEDS_OBJECT[drafter]} (names that work: {DRAFTER_NAMES})")
        raise ValueError(
            f"unknown drafter {drafter!r}; use one of {DRAFTER_NAMES} or an instance from specdec.drafters "
            "(NGramDrafter, DraftModelDrafter, MedusaDrafter, MTPDrafter, or your own Drafter subclass)"
        )
    raise TypeError(
        f"drafter must be one of {DRAFTER_NAMES} or a specdec.drafters.Drafter instance, got {type(drafter).__name__}; "
        "wrap a draft model as specdec.drafters.DraftModelDrafter(model)"
    )
