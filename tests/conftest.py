import os
import sys
import warnings

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
# tiny models gain nothing from intra-op threads, and OpenMP spin-waiting makes 2 threads
# 50x slower when another process shares the 2 cores
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

from tiny_models import FAMILIES, make_model, perturbed_copy  # noqa: E402

_MODELS: dict = {}


def get_model(family: str, kind: str = "target"):
    """Cached tiny models: kind in {"target", "perturbed", "small"}."""
    key = (family, kind)
    if key not in _MODELS:
        if kind == "target":
            _MODELS[key] = make_model(family, seed=0)
        elif kind == "perturbed":
            _MODELS[key] = perturbed_copy(get_model(family, "target"))
        elif kind == "small":
            _MODELS[key] = make_model(family, seed=1, small=True)
        else:
            raise ValueError(kind)
    return _MODELS[key]


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
