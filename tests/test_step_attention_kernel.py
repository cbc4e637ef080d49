"""The step-attention kernel (:func:`specdec.kernels.attention.step_attention`) against its fp32
torch reference (through Triton's interpreter at tiny sizes; compiled with ``SPECDEC_TEST_CUDA=1``),
on fresh random inputs laid out as attention layers pass them (queries as transposed views of
``[B, t, H, D]`` projections, keys and values as views of a longer static cache), with additive
masks that hide padding and future columns, boolean masks and none."""

from __future__ import annotations

import pytest
import torch
from markers import ON_CUDA, needs_cuda, needs_triton_interpreter

from specdec.kernels.attention import step_attention, step_attention_fits, step_attention_reference

DEVICE = "cuda" if ON_CUDA else "cpu"

pytestmark = needs_triton_interpreter if not ON_CUDA else []

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def case(B, H, Hkv, t, D, Dv, L, dtype, seed, span=None):
    """q [B, H, t, D] (a view of [B, t, H, D]); k / v the first L of ``span`` columns of a cache;
    an additive mask hiding each row's left padding and the step's future tokens (min of the
    dtype, as transformers builds them)."""
    gen = torch.Generator().manual_seed(seed)
    span = span or L
    q = torch.randn(B, t, H, D, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(B, Hkv, span, D, generator=gen).to(DEVICE, dtype)[:, :, :L]
    v = torch.randn(B, Hkv, span, Dv, generator=gen).to(DEVICE, dtype)[:, :, :L]
    pad = torch.randint(0, max(1, L - t - 1), (B,), generator=gen)
    cols = torch.arange(L)
    # token j of the step sits at column L - t + j and sees columns >= pad and <= its own
    keep = (cols[None, None, :] >= pad[:, None, None]) & (cols[None, None, :] <= (L - t + torch.arange(t))[None, :, None])
    mask = torch.zeros(B, 1, t, L).masked_fill(~keep[:, None], torch.finfo(dtype).min).to(DEVICE, dtype)
    return q, k, v, mask, keep[:, None].to(DEVICE)


def rel_err(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_CUDA else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, Hkv, t, D, Dv, L", [
    (1, 4, 1, 1, 16, 16, 37),      # one KV head, a one-token step, columns not a multiple of the tile
    (2, 8, 2, 5, 32, 32, 70),      # a verify step: R t = 20 rows, two row tiles
    (3, 6, 3, 3, 24, 40, 200),     # head widths that are not powers of two, many splits
    (2, 4, 4, 2, 16, 16, 33),      # no grouping (H = H_kv)
])
def test_kernel_equals_the_reference(dtype, B, H, Hkv, t, D, Dv, L):
    """Within the dtype's rounding of the fp32 reference, for additive, boolean and no mask."""
    q, k, v, mask, keep = case(B, H, Hkv, t, D, Dv, L, dtype, seed=B * 100 + t * 10 + L)
    scale = 0.7 * D ** -0.5
    for m in (mask, keep, None):
        want = step_attention_reference(q, k, v, m, scale)
        got = step_attention(q, k, v, m, scale, backend_name="triton")
        assert got.shape == (B, t, H, Dv) and got.dtype == dtype
        assert rel_err(got, want) < TOL[dtype], f"mask {None if m is None else m.dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_rows_result_does_not_depend_on_the_step_width(dtype):
    """Token i of a t-token step equals the same query alone bit for bit over the same columns
    (its mask row): over a static cache's span a verify step's rows are a plain step's. On CUDA
    bit for bit; under the CPU interpreter to the dtype's rounding only, since its dots are numpy
    matmuls, and numpy's BLAS (numpy 2.4.6) rounds a row differently by its position in the
    16-row tile, which the kernel's own dots do not."""
    B, H, Hkv, t, D, L = 2, 8, 2, 5, 32, 90
    q, k, v, mask, _ = case(B, H, Hkv, t, D, D, L, dtype, seed=7)
    full = step_attention(q, k, v, mask, backend_name="triton")
    for i in range(t):
        one = step_attention(q[:, :, i:i + 1], k, v, mask[:, :, i:i + 1], backend_name="triton")
        if ON_CUDA:
            assert torch.equal(one[:, 0], full[:, i]), f"token {i}"
        else:
            assert rel_err(one[:, 0], full[:, i]) < (1e-6 if dtype == torch.float32 else 1e-3), f"token {i}"


def test_masks_broadcast_and_fully_masked_rows_give_zeros():
    """A ``[1, 1, 1, L]`` mask broadcasts over rows and tokens; a row whose columns are all masked
    gives zeros (not NaN), as the reference does."""
    q, k, v, _, _ = case(2, 4, 2, 3, 16, 16, 40, torch.float32, seed=3)
    wide = torch.zeros(1, 1, 1, 40, device=DEVICE)
    wide[..., :7] = float("-inf")
    assert rel_err(step_attention(q, k, v, wide, backend_name="triton"),
                   step_attention_reference(q, k, v, wide)) < TOL[torch.float32]
    none = torch.zeros(2, 1, 3, 40, dtype=torch.bool, device=DEVICE)
    none[0] = True
    got = step_attention(q, k, v, none, backend_name="triton")
    assert torch.equal(got[1], torch.zeros_like(got[1])) and rel_err(got[0], step_attention_reference(q, k, v, none)[0]) < 1e-5


def test_refused_inputs_raise_and_say_what_is_accepted():
    q, k, v, mask, _ = case(1, 4, 2, 1, 16, 16, 20, torch.float32, seed=5)
    assert step_attention_fits(q, k, v, mask)
    many = torch.randn(1, 4, 20000, 16, device=DEVICE)  # 4 heads x 20,000 tokens: 80,000 rows over one KV head
    for args in ((q, k[:, :1].expand(1, 3, 20, 16), v[:, :1].expand(1, 3, 20, 16), mask),  # 4 heads over 3
                 (many, k[:, :1], v[:, :1], None),
                 (q, k, v.double(), mask), (q, k, v, mask[..., :10]),
                 (q, torch.randn(1, 2, 20, 512, device=DEVICE), torch.randn(1, 2, 20, 512, device=DEVICE), mask)):
        assert not step_attention_fits(*args)
        with pytest.raises(ValueError, match="expected query"):
            step_attention(*args, backend_name="triton")


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("H, Hkv, D, t, L", [(16, 4, 256, 1, 512), (16, 4, 256, 5, 512), (32, 8, 128, 5, 2048)])
def test_bench_shapes_against_sdpa_on_gpu(H, Hkv, D, t, L):
    """bf16 at the bench models' attention shapes: within bf16 rounding of torch's SDPA and of the
    fp32 reference, and a CUDA-graph replay equal to the eager call."""
    import torch.nn.functional as F

    q, k, v, mask, _ = case(4, H, Hkv, t, D, D, L, torch.bfloat16, seed=11)
    got = step_attention(q, k, v, mask)
    sdpa = F.scaled_dot_product_attention(q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1),
                                          attn_mask=mask).transpose(1, 2)
    assert rel_err(got, step_attention_reference(q, k, v, mask)) < TOL[torch.bfloat16]
    assert rel_err(got, sdpa) < TOL[torch.bfloat16]
    out = torch.empty_like(got)
    qs = q.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(step_attention(qs, k, v, mask))
    qs.copy_(torch.randn_like(qs))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, step_attention(qs, k, v, mask))


@needs_triton_interpreter
# (Qwen3.5's small model on the eager path with the kernel on stays exact by default in test_triton_engine.py::
# test_triton_backend_exact[qwen3_5-replay], whose verify steps run it; the kernel's calls and the switch: Mistral's)
@pytest.mark.parametrize("family, path", [pytest.param("qwen3_5", "eager", marks=pytest.mark.slow), ("mistral", "static")])
def test_models_stay_exact_with_the_kernel(monkeypatch, family, path):
    """On the Triton backend (``SPECDEC_STEP_ATTENTION_KERNEL`` unset: on) every grouped-query step
    attention runs the kernel, and speculative greedy output equals HF greedy ``generate`` (fp32;
    Mistral's sliding window shorter than prompt + new tokens)."""
    import specdec.kernels.attention as attention
    import specdec.models.step_attention as step_attention_mod
    from helpers import hf_greedy
    from tiny_models import get_model, ragged_prompts

    import specdec

    model = get_model(family, "small")  # (Qwen3.5's: one Gated DeltaNet and one attention layer)
    ids, mask = ragged_prompts()
    ref = hf_greedy(model, ids, mask, 8)
    calls = []
    real = attention.step_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(step_attention_mod, "step_attention", counting)
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    monkeypatch.delenv("SPECDEC_STEP_ATTENTION_KERNEL", raising=False)
    sd = specdec.wrap(model, drafter="ngram", num_speculative_tokens=3, decode_path=path)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=8, pad_token_id=0), ref)
    assert calls and max(calls) > 1  # verify steps of several tokens ran it
    monkeypatch.setenv("SPECDEC_STEP_ATTENTION_KERNEL", "0")
    calls.clear()
    # (4 new tokens: every step attention of them, one token or several, stays off the kernel)
    assert torch.equal(sd.generate(ids, attention_mask=mask, max_new_tokens=4, pad_token_id=0),
                       hf_greedy(model, ids, mask, 4))
    assert not calls
