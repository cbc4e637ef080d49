import os
import sys
import warnings

#: ``SPECDEC_TEST_CUDA=1``: Triton compiles for the GPU (the ``gpu`` tests, real sizes); otherwise
#: every Triton kernel runs through Triton's CPU interpreter at tiny sizes. Decided here, once per
#: test process and before any test module defines a Triton kernel: ``TRITON_INTERPRET=1`` holds
#: process-wide (Triton reads it when a kernel is defined, torch.compile when it builds one), and
#: interpreted kernels copy CUDA tensors to the host, so no CUDA graph can be captured under it.
ON_CUDA = os.environ.get("SPECDEC_TEST_CUDA", "0") == "1"
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
else:
    from specdec.graphs import capture_blocker

    if (_blocker := capture_blocker()) is not None:
        raise RuntimeError(f"SPECDEC_TEST_CUDA=1 runs the GPU tests, but {_blocker} (or drop SPECDEC_TEST_CUDA "
                           "for the CPU suite)")

import pytest  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
# tiny models gain nothing from intra-op threads, and OpenMP spin-waiting makes 2 threads
# 50x slower when another process shares the 2 cores
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

from tiny_models import FAMILIES, make_model, perturbed_copy  # noqa: E402

#: for the ``gpu`` tests: the run must be a CUDA test run (Triton compiled, not interpreted)
needs_cuda = pytest.mark.skipif(not (ON_CUDA and torch.cuda.is_available()), reason="needs CUDA and SPECDEC_TEST_CUDA=1")
#: for tests that run Triton kernels on CPU tensors (Triton's interpreter): off under SPECDEC_TEST_CUDA=1
needs_triton_interpreter = pytest.mark.skipif(ON_CUDA, reason="runs Triton kernels on CPU tensors through Triton's "
                                              "interpreter, which SPECDEC_TEST_CUDA=1 turns off")

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
