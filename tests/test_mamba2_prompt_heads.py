"""The Mamba-2 prompt scan's per-head passes (:func:`specdec.kernels.mamba2.chunked.discretized_input`,
:func:`~specdec.kernels.mamba2.chunked.add_skip_`): the Triton kernels (Triton's interpreter at tiny
sizes; compiled with ``SPECDEC_TEST_CUDA=1``) against their torch forms, on fresh random inputs with
``x`` a slice of a wider conv output as the scan gets it, outputs poisoned first and the inputs
checked untouched."""

from __future__ import annotations

import pytest
import torch
from helpers import within_ulp
from markers import ON_CUDA, needs_triton_interpreter

from specdec.kernels.mamba2 import chunked
from specdec.kernels.mamba2.triton_heads import add_skip_triton_, discretized_input_triton

DEVICE = "cuda" if ON_CUDA else "cpu"

pytestmark = needs_triton_interpreter if not ON_CUDA else []


def _inputs(B, L, H, P, dtype, seed):
    """``x [B, L, H, P]``, a slice of a ``[B, L, H * P + 2 * 12]`` conv output (as x sits before B
    and C), ``dt [B, L, H]`` fp32 > 0, ``D [H]`` fp32, ``y [B, L, H, P]`` in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randn(B, L, H * P + 24, generator=gen).to(DEVICE, dtype)
    x = conv[..., : H * P].view(B, L, H, P)
    dt = torch.rand(B, L, H, generator=gen).add(0.01).to(DEVICE)
    D = torch.randn(H, generator=gen).to(DEVICE)
    y = torch.randn(B, L, H, P, generator=gen).to(DEVICE, dtype)
    return conv, x, dt, D, y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, L, H, P", [(2, 5, 20, 24), (1, 3, 4, 64), (3, 1, 16, 8)])
def test_kernels_are_the_torch_forms(B, L, H, P, dtype):
    """``dt x`` rounded once to the operand dtype: bit for bit (one fp32 product), but for bf16
    outputs under the interpreter, which truncates bf16 conversions where the GPU rounds (within
    one unit in the last place there); ``y + x D`` in place, within one unit in the last place
    (torch's multiply-add may be fused where the kernel's is not, or the other way round), bit for
    bit in fp16 under the interpreter, where the final rounding hides that; heads not a multiple of the kernel's block, a head size not a power of two, one
    prompt and several, one token."""
    conv, x, dt, D, y = _inputs(B, L, H, P, dtype, seed=B * 100 + H)
    before = (conv.clone(), dt.clone(), D.clone())

    def check(got, want, exact):
        if exact:
            assert torch.equal(got, want)
        else:
            assert within_ulp(got, want)

    for out_dtype in {dtype, torch.bfloat16}:
        want = torch.mul(x, dt[..., None], out=x.new_empty(x.shape, dtype=out_dtype))
        got = discretized_input_triton(x, dt, out_dtype)
        assert got.dtype == out_dtype and got.is_contiguous()
        check(got, want, ON_CUDA or out_dtype != torch.bfloat16)
    want = y.clone().addcmul_(x, D[:, None])
    got = y.clone()
    assert add_skip_triton_(got, x, D) is got
    check(got, want, not ON_CUDA and dtype == torch.float16)
    assert all(torch.equal(a, b) for a, b in zip((conv, dt, D), before))


def test_the_scan_runs_them_on_the_triton_backend(monkeypatch):
    """``discretized_input`` / ``add_skip_`` launch the kernels on the Triton backend and the torch
    forms on the torch backend, with the same results; a contiguous ``x`` and a non-contiguous one
    whose tokens are not evenly strided (read from a copy) too."""
    conv, x, dt, D, y = _inputs(2, 4, 6, 8, torch.bfloat16, seed=7)
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("SPECDEC_BACKEND", backend)
        calls = []
        monkeypatch.setattr("specdec.kernels.mamba2.triton_heads._heads_kernel", _Counting(calls))
        uneven = x.transpose(0, 1).contiguous().transpose(0, 1)  # the tokens' strides not batch-major
        runs[backend] = [chunked.discretized_input(t, dt, torch.bfloat16) for t in (x, x.contiguous(), uneven)]
        runs[backend].append(chunked.add_skip_(y.clone(), x, D))
        assert (len(calls) == 4) == (backend == "triton"), (backend, calls)
    for a, b in zip(runs["torch"], runs["triton"]):  # (bf16: the interpreter truncates, one unit at most)
        assert within_ulp(b, a)


def test_any_layout_of_x():
    """``x`` whose heads are not ``P`` apart (a slice of wider heads), whose size-1 dims carry odd
    strides (a transposed one-token batch, which PyTorch calls contiguous), one token of several
    prompts sliced from the conv output (read in place), and a layout read from a copy (channels
    not contiguous) give the torch forms' results."""
    gen = torch.Generator().manual_seed(11)
    wide = torch.randn(2, 3, 5, 2 * 8, generator=gen).to(DEVICE)
    conv = torch.randn(3, 1, 5 * 8 + 6, generator=gen).to(DEVICE)
    for x in (wide[..., :8], torch.randn(1, 2, 5, 8, generator=gen).to(DEVICE).transpose(0, 1),
              conv[..., :40].view(3, 1, 5, 8), wide[..., :8].transpose(2, 3).contiguous().transpose(2, 3)):
        B, L, H, P = x.shape
        dt = torch.rand(B, L, H, generator=gen).to(DEVICE)
        D = torch.randn(H, generator=gen).to(DEVICE)
        y = torch.randn(B, L, H, P, generator=gen).to(DEVICE)
        assert torch.equal(discretized_input_triton(x, dt, torch.float32), x * dt[..., None])
        got = add_skip_triton_(y.clone(), x, D)
        assert ((got - y.addcmul(x, D[:, None])).abs() <= y.abs().add(1) * 1e-6).all()


class _Counting:
    """Stands for the kernel in ``monkeypatch``: counts launches, then launches it."""

    def __init__(self, calls):
        from specdec.kernels.mamba2 import triton_heads

        self.calls, self.kernel = calls, triton_heads._heads_kernel

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("call, match", [
    (lambda x, dt, D, y: chunked.discretized_input(x, dt[:, :1], torch.float32), "dt"),
    (lambda x, dt, D, y: chunked.add_skip_(y[:, :1], x, D), "expected y"),
    (lambda x, dt, D, y: chunked.add_skip_(y, x, D[:2]), "expected y"),
    (lambda x, dt, D, y: chunked.add_skip_(y.transpose(1, 2).contiguous().transpose(1, 2), x, D), "not contiguous"),
])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bad_input_is_named(call, match, backend, monkeypatch):
    monkeypatch.setenv("SPECDEC_BACKEND", backend)
    _, x, dt, D, y = _inputs(2, 3, 4, 8, torch.float32, seed=3)
    with pytest.raises(ValueError, match=match):
        call(x, dt, D, y)


def test_the_kernels_refuse_other_dtypes():
    _, x, dt, D, y = _inputs(2, 3, 4, 8, torch.float32, seed=4)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        discretized_input_triton(x.double(), dt, torch.float32)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        discretized_input_triton(x, dt, torch.float64)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        add_skip_triton_(y.double(), x.double(), D)
