import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(__file__))

# markers imports neither specdec nor Triton: no Triton kernel is defined before the decision below
from markers import ON_CUDA  # noqa: E402

#: ``SPECDEC_TEST_CUDA=1`` (``markers.ON_CUDA``): Triton compiles for the GPU (the ``gpu`` tests,
#: real sizes); otherwise every Triton kernel runs through Triton's CPU interpreter at tiny sizes.
#: Decided here, once per test process and before any test module defines a Triton kernel:
#: ``TRITON_INTERPRET=1`` holds process-wide (Triton reads it when a kernel is defined,
#: torch.compile when it builds one), and interpreted kernels copy CUDA tensors to the host, so
#: no CUDA graph can be captured under it.
if not ON_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    # the interpreter without its builtin search at every jit call (results unchanged; see the module)
    from interpreter_speedup import cache_builtin_lookups

    cache_builtin_lookups()
else:
    from specdec.graphs import capture_blocker

    if (_blocker := capture_blocker()) is not None:
        raise RuntimeError(f"SPECDEC_TEST_CUDA=1 runs the GPU tests, but {_blocker} (or drop SPECDEC_TEST_CUDA "
                           "for the CPU suite)")

import pytest  # noqa: E402
import torch  # noqa: E402

# tiny models gain nothing from intra-op threads, and OpenMP spin-waiting makes 2 threads
# 50x slower when another process shares the 2 cores
torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*falling back to its reference PyTorch implementation.*")

from tiny_models import FAMILIES  # noqa: E402


@pytest.fixture(params=FAMILIES)
def family(request):
    return request.param
