"""Static instruction counts of the step kernels for sm_90 per launch configuration, on a
machine without a GPU: what a launch setting changes in the compiled code before it is timed.

For each configuration (state block, num_warps, prefetch: a :class:`specdec.kernels.LaunchConfig`
of the op's Triton kernel set) it compiles the kernel set's plain multi-token update and fused
replay verify at the kernel table's shapes (K = 4: T = 5 tokens, unrolled; the replay history
the library's replay strategy keeps) through Triton's full pipeline
(``benchmarks/triton_sm90_compile.py``) and prints, per
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
import sys

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("run without TRITON_INTERPRET: this script compiles the kernels for sm_90")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.dirname(os.path.abspath(__file__))]

import torch  # noqa: E402
import triton  # noqa: E402

import triton_sm90_compile as sm90  # noqa: E402  (intercepts the kernels' launches: compile only)
from sweep_rollback_configs import launch_of, parse_configs  # noqa: E402
from specdec.experiments.kernel_table import SHAPES  # noqa: E402
from specdec.experiments.kernel_timing import synthetic_inputs, synthetic_params  # noqa: E402
from specdec.kernels import OPS  # noqa: E402

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
    sass = sm90.cuobjdump(compiled, "-sass")
    if sass is None:
        raise SystemExit("this Triton ships no cuobjdump: no SASS to count")
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", sass)
    out = {"instr": len(ops)}
    out.update({k: sum(o.startswith(k) for o in ops) for k in OPS_COUNTED})
    return out


def calls(op: str, cfg):
    """(name, thunk) of the kernel set's plain update and fused replay verify of ``op`` launched with
    ``cfg`` (block, num_warps, prefetch), on CPU tensors (the launches are intercepted)."""
    B, T = 2, 5
    shape, gen = SHAPES["bench"][op], torch.Generator().manual_seed(0)
    kern = OPS[op].on("triton").kernels.with_launch(launch_of(cfg))  # no device: compiled, not interpreted
    params = synthetic_params(shape, "cpu", gen)
    inputs = synthetic_inputs(shape, B, T, "cpu", gen, dtype=torch.bfloat16)
    s = torch.zeros(B, *shape.state_shape)
    hist = {k: torch.zeros(B, 2 * T, *sh, dtype=dt) for k, (sh, dt) in OPS[op].replay_spec(inputs).items()}
    hist_len = torch.zeros(B, dtype=torch.long)
    return [("update", lambda: kern.update(s, inputs, params)),
            ("replay_fused", lambda: kern.replay_verify(s, hist, hist_len, inputs, params, 0, fused=True))]


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
        for name, thunk in calls(args.op, (block, warps, pf)):
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
