"""Static instruction counts of the step kernels for sm_90 per launch configuration, on a
machine without a GPU: what a launch setting changes in the compiled code before it is timed.

For each configuration (state block, num_warps, prefetch) it compiles the plain multi-token
update and the fused replay verify at the benchmark's head shapes (K = 4: T = 5 tokens,
unrolled) through Triton's full pipeline (``tests/triton_sm90_compile.py``) and prints, per
kernel, registers / spills and the SASS counts of barriers (BAR), warp shuffles (SHFL), shared
memory stores / loads (STS / LDS), fused multiply-adds (FFMA) and global loads / stores
(LDG / STG). Counts are per thread over the whole unrolled step (divide by T for per token).
Cross-warp reductions show up as BAR + STS/LDS; a one-warp program reduces with SHFL only.
``def`` is what ``_launch_config`` picks at the compiled batch (2: the small-batch setting).

    python benchmarks/sass_configs.py --op gdn --configs "16,2,5;8,1,5;16,1,5"
    python benchmarks/sass_configs.py --op mamba2 --configs "32,4,0;8,1,5"

Timing stays with ``benchmarks/sweep_rollback_configs.py --configs ...`` on the GPU.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: this script compiles the kernels for sm_90")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import triton_sm90_compile as sm90  # noqa: E402  (intercepts the kernels' launches: compile only)
from sweep_rollback_configs import parse_configs  # noqa: E402
from specdec.kernels.gdn import triton_step as dr  # noqa: E402
from specdec.kernels.mamba2 import triton_step as m2  # noqa: E402

OPS_COUNTED = ("BAR", "SHFL", "STS", "LDS", "FFMA", "LDG", "STG")
_COMPILED: list = []


def _record(compile_fn):
    def wrapped(*args, **kwargs):
        c = compile_fn(*args, **kwargs)
        _COMPILED.append(c)
        return c
    return wrapped


def sass_counts(compiled) -> dict:
    """Instruction counts of one compiled kernel's SASS (via the cuobjdump Triton bundles)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)
    out = {"instr": len(ops)}
    out.update({k: sum(o.startswith(k) for o in ops) for k in OPS_COUNTED})
    return out


def calls(op: str, tune: dict):
    """(name, thunk) of the plain update and the fused replay verify of ``op`` with ``tune``."""
    B, T, L, bf = 2, 5, 10, torch.bfloat16
    hl = torch.zeros(B, dtype=torch.long)
    if op == "mamba2":
        H, P, G, N = 128, 64, 8, 128
        x, dt = torch.randn(B, T, H, P, dtype=bf), torch.rand(B, T, H, dtype=bf)
        A, D = -torch.rand(H), torch.randn(H)
        Bm, Cm = torch.randn(B, T, G, N, dtype=bf), torch.randn(B, T, G, N, dtype=bf)
        s = torch.zeros(B, H, P, N)
        hx, hdt, hB = torch.zeros(B, L, H, P, dtype=bf), torch.zeros(B, L, H, dtype=bf), torch.zeros(B, L, G, N, dtype=bf)
        return [("update", lambda: m2.mamba2_update(s, x, dt, A, Bm, Cm, D, None, **tune)),
                ("replay_fused", lambda: m2.mamba2_replay_verify(s, hx, hdt, hB, hl, x, dt, A, Bm, Cm, D, 0, None,
                                                                 fused=True, **tune))]
    H, K, V = 32, 128, 128
    q = F.normalize(torch.randn(B, T, H, K), dim=-1).to(bf)
    k, v = q.clone(), torch.randn(B, T, H, V, dtype=bf)
    g = -torch.rand(B, T, H, K).to(bf) if op == "kda" else -torch.rand(B, T, H).to(bf)
    beta = torch.rand(B, T, H, dtype=bf)
    s = torch.zeros(B, H, K, V)
    hk, hg, hu = torch.zeros(B, L, H, K), torch.zeros(B, L, *g.shape[2:]), torch.zeros(B, L, H, V)
    return [("update", lambda: dr.delta_rule_update(s, q, k, v, g, beta, None, **tune)),
            ("replay_fused", lambda: dr.delta_rule_replay_verify(s, hk, hg, hu, hl, q, k, v, g, beta, 0, None,
                                                                 fused=True, **tune))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", default="gdn", choices=["gdn", "kda", "mamba2"])
    ap.add_argument("--configs", default="def;16,2,5;8,1,5",
                    help="block,num_warps,prefetch triples separated by ';' (def = the default), as the sweep takes")
    args = ap.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
    except ValueError as err:
        ap.error(str(err))
    triton.compile = _record(triton.compile)
    print(f"| op | kernel | config | regs | spill bytes | " + " | ".join(("instr",) + OPS_COUNTED) + " |")
    print("|---|---|---|---:|---:|" + "---:|" * (len(OPS_COUNTED) + 1))
    for block, warps, pf in configs:
        tune = {k: v for k, v in (("block_p" if args.op == "mamba2" else "block_v", block), ("num_warps", warps),
                                  ("prefetch", pf)) if v is not None}
        for name, thunk in calls(args.op, tune):
            _COMPILED.clear()
            sm90._SEEN.clear()
            thunk()
            for c in _COMPILED:
                usage = sm90._resource_usage(c)
                m = re.search(r"regs=(\d+) .*local\(spill\)=(\d+)", usage)
                regs, spill = (m.group(1), m.group(2)) if m else ("?", "?")
                n = sass_counts(c)
                cfg = f"{block or 'def'},{warps or 'def'},{'def' if pf is None else pf}"
                print(f"| {args.op} | {name} | {cfg} | {regs} | {spill} | "
                      + " | ".join(str(n[k]) for k in ("instr",) + OPS_COUNTED) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
