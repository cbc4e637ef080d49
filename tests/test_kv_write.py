"""A step's keys and values written into a static KV cache (:func:`specdec.kernels.kv.write_kv`):
the one-launch Triton kernel against the torch reference (through Triton's interpreter at tiny
sizes; compiled with ``SPECDEC_TEST_CUDA=1``), on fresh random buffers and inputs, keys and
values as attention layers pass them (transposed views), every column of the buffers compared
bit for bit, the ones not written included.
"""

from __future__ import annotations

import pytest
import torch
from helpers import built_for_hopper
from markers import ON_CUDA, needs_triton_interpreter

from specdec.kernels.kv import write_kv, write_kv_reference

DEVICE = "cuda" if ON_CUDA else "cpu"

pytestmark = needs_triton_interpreter if not ON_CUDA else []


def case(B, H, t, Dk, Dv, L, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    kbuf = torch.randn(B, H, L, Dk, generator=gen).to(DEVICE, dtype)
    vbuf = torch.randn(B, H, L, Dv, generator=gen).to(DEVICE, dtype)
    # as attention layers pass them: [B, t, H, D] projections viewed as [B, H, t, D]
    keys = torch.randn(B, t, H, Dk, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    values = torch.randn(B, t, H, Dv, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    seq_len = torch.randint(0, L - t - 3, (B,), generator=gen).to(DEVICE)
    return kbuf, vbuf, keys, values, seq_len


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B, H, t, Dk, Dv, offset", [(1, 1, 1, 8, 8, 0), (3, 2, 5, 16, 16, 0), (2, 3, 4, 24, 12, 2)])
def test_kernel_equals_the_reference(dtype, B, H, t, Dk, Dv, offset):
    """Each row's step columns hold its keys / values, every other column is untouched, and the
    buffers equal the torch writes' bit for bit; keys and values are unchanged."""
    kbuf, vbuf, keys, values, seq_len = case(B, H, t, Dk, Dv, 24, dtype, seed=B * 10 + t)
    want_k, want_v = kbuf.clone(), vbuf.clone()
    write_kv_reference(want_k, want_v, keys, values, seq_len, offset)
    k_in, v_in = keys.clone(), values.clone()
    write_kv(kbuf, vbuf, keys, values, seq_len, offset, backend_name="triton")
    assert torch.equal(kbuf, want_k) and torch.equal(vbuf, want_v)
    assert torch.equal(keys, k_in) and torch.equal(values, v_in)
    for b in range(B):  # the reference itself writes where it should
        cols = int(seq_len[b]) + offset + torch.arange(t)
        assert torch.equal(want_k[b][:, cols], keys[b]) and torch.equal(want_v[b][:, cols], values[b])


def test_what_the_kernel_does_not_take_runs_the_reference():
    """Keys in another dtype than the buffer are cast as the torch write casts them (the kernel
    only copies), other value than key heads and a strided ``seq_len`` are written as the torch
    write does; a step of no token writes nothing."""
    kbuf, vbuf, keys, values, seq_len = case(2, 2, 3, 8, 8, 16, torch.bfloat16, seed=3)
    want_k, want_v = kbuf.clone(), vbuf.clone()
    write_kv_reference(want_k, want_v, keys.float(), values.float(), seq_len, 1)
    write_kv(kbuf, vbuf, keys.float(), values.float(), seq_len, 1, backend_name="triton")
    assert torch.equal(kbuf, want_k) and torch.equal(vbuf, want_v)
    vbuf1, values1 = vbuf[:, :1].clone(), values[:, :1]
    want_v1 = vbuf1.clone()
    write_kv_reference(want_k, want_v1, keys, values1, seq_len, 0)
    write_kv(kbuf, vbuf1, keys, values1, seq_len, 0, backend_name="triton")
    assert torch.equal(kbuf, want_k) and torch.equal(vbuf1, want_v1)
    strided = torch.stack([seq_len, seq_len + 1], 1)[:, 1]  # [B], stride 2
    write_kv_reference(want_k, want_v, keys, values, strided.contiguous(), 0)
    write_kv(kbuf, vbuf, keys, values, strided, 0, backend_name="triton")
    assert torch.equal(kbuf, want_k) and torch.equal(vbuf, want_v)
    before = kbuf.clone()
    write_kv(kbuf, vbuf, keys[:, :, :0], values[:, :, :0], seq_len, 0, backend_name="triton")
    assert torch.equal(kbuf, before)


@pytest.mark.parametrize("change", [
    lambda c: {**c, "values": c["values"][:, :1]},
    lambda c: {**c, "kbuf": c["kbuf"][..., :4]},
    lambda c: {**c, "seq_len": c["seq_len"][:1]},
    lambda c: {**c, "vbuf": c["vbuf"][:, :, :8]},
])
def test_bad_shapes_are_named(change):
    kbuf, vbuf, keys, values, seq_len = case(2, 2, 3, 8, 8, 16, torch.float32, seed=4)
    args = change({"kbuf": kbuf, "vbuf": vbuf, "keys": keys, "values": values, "seq_len": seq_len})
    with pytest.raises(ValueError, match="write_kv: expected keys"):
        write_kv(**args, offset=0, backend_name="triton")


_BUILD_FOR_HOPPER = """
from specdec.kernels.kv import triton_kv

types = {**{n: "*bf16" for n in ("kbuf", "vbuf", "keys", "values")}, "seq_len": "*i64"}
ptx = hopper_ptx(triton_kv._write_kv_kernel, dict(H=8, DK=128, DV=128, BK=128, BV=128), types)
print(json.dumps({"stores": ptx.count("st.global")}))
"""


def test_kernel_builds_for_hopper():
    """The kernel compiles ahead of time for an H100/H200 (sm_90) with bf16 buffers, using
    Triton's own ptxas, on a machine without a GPU (in a child process: this one interprets)."""
    assert built_for_hopper(_BUILD_FOR_HOPPER)["stores"] > 0
