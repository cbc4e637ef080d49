"""What this test run can do, and the skip markers built on it.

``SPECDEC_TEST_CUDA=1`` makes a CUDA test run: Triton compiles for the GPU and the ``gpu`` tests
run at real sizes. Otherwise every Triton kernel runs through Triton's CPU interpreter at tiny
sizes (``conftest.py`` sets ``TRITON_INTERPRET=1`` for such a run before any test module loads).
"""

from __future__ import annotations

import os

import pytest
import torch

#: a CUDA test run (``SPECDEC_TEST_CUDA=1``): Triton compiled, not interpreted
ON_CUDA = os.environ.get("SPECDEC_TEST_CUDA", "0") == "1"

#: for the ``gpu`` tests: the run must be a CUDA test run (Triton compiled, not interpreted)
needs_cuda = pytest.mark.skipif(not (ON_CUDA and torch.cuda.is_available()), reason="needs CUDA and SPECDEC_TEST_CUDA=1")
#: for tests that run Triton kernels on CPU tensors (Triton's interpreter): off under SPECDEC_TEST_CUDA=1
needs_triton_interpreter = pytest.mark.skipif(ON_CUDA, reason="runs Triton kernels on CPU tensors through Triton's "
                                              "interpreter, which SPECDEC_TEST_CUDA=1 turns off")
