"""The skinny linear kernel against cuBLAS (``experiment=skinny_linear``): device time of
``F.linear`` and :func:`specdec.kernels.linear.skinny_linear` on every distinct ``nn.Linear``
weight shape of the bench models, for M = 1 .. 64 rows.

The shapes come from the models' own configs (``conf/model/<name>.yaml``, ``source:
random_shape``): the model is built on the meta device (no memory) and its ``nn.Linear``
modules listed (:func:`linear_shapes`), the LM head included; a shape used by several layers is
timed once and counted for each (``experiment.max_weight_mib`` leaves larger weights out).
Weights, x and biases are random in ``dtype`` (bf16 on CUDA).

Timing (:func:`~specdec.experiments.kernel_timing.time_in_graph`): a CUDA graph of at least
``experiment.min_calls`` calls over copies of the weight rotated until they span >= 256 MiB (an
H200's L2 holds 50 MiB; in a forward every weight arrives cold), median of
``experiment.reps`` replays, per call. Bytes: the weight, x and the output, read or written
once; GB/s against a measured device-to-device copy
(:func:`~specdec.experiments.kernel_timing.copy_bandwidth`). Per model, the linear time of one
forward at each M: every layer's matrix, F.linear against the kernel (``summary.md``).

With ``experiment.groups`` the sibling groups the CUDA-graph decode path merges
(:func:`sibling_shapes`: e.g. a layer's q / k / v) are timed too, as F.linear per member
against one :func:`~specdec.kernels.linear.grouped_skinny_linear` launch (``members_kernel_us``:
the skinny kernel per member), and summed per forward in ``summary.md``.

With ``experiment.check`` each shape is first checked at the largest M: relative RMS error
against the fp32 reference, and rows equal bit for bit to 1-row calls (batch invariance).
``experiment.sweep`` also times each launch of :data:`SWEEP` and records the fastest.

    specdec-run experiment=skinny_linear                                  # CUDA
    TRITON_INTERPRET=1 specdec-run experiment=skinny_linear device=cpu experiment.models=[qwen35-tiny-shape] \\
        experiment.rows=[1,3] experiment.min_calls=1 experiment.max_weight_mib=1   # CPU smoke run (interpreter)

Outputs: ``results.jsonl`` (one record per model, weight shape and M) and ``summary.md``.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from .config import CONF_DIR
from .kernel_timing import copy_bandwidth, time_in_graph
from .models import resolve_device, target_config

__all__ = ["LinearShape", "SWEEP", "model_spec", "linear_shapes", "sibling_shapes", "validate", "run"]

#: rotate weight copies until they span at least this many bytes (H200 L2: 50 MiB)
ROT_BYTES = 256 << 20
#: launch settings ``experiment.sweep`` times besides the default: (block_n, block_k, num_warps, num_stages, waves),
#: K split as the default rule splits it for that tile to fill ``waves`` programs per SM
SWEEP = [(64, 128, 4, 4, 2), (64, 128, 4, 3, 1), (64, 256, 4, 3, 1), (32, 256, 4, 3, 1), (128, 128, 8, 3, 1),
         (128, 64, 4, 4, 2), (64, 64, 4, 6, 2)]


@dataclasses.dataclass(frozen=True)
class LinearShape:
    """One distinct weight shape ``[N, K]`` of a model: the ``names`` of its modules (one per layer
    using it) and ``bias`` (whether they have one)."""

    N: int
    K: int
    names: tuple[str, ...]
    bias: bool
    #: a sibling group (:func:`sibling_shapes`): each member's N (``N`` is their sum); () for one weight
    members: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """E.g. ``mlp.down_proj 2560x9216``: the first module's name without its layer index; a group's
        ``self_attn.q_proj+k_proj+v_proj 8192+1024+1024x2560``."""
        parts = self.names[0].split(".")
        short = ".".join(p for p in parts if not p.isdigit() and p not in ("model", "layers"))
        return f"{short} {'+'.join(map(str, self.members)) if self.members else self.N}x{self.K}"


def model_spec(name: str):
    """The first target of ``conf/model/<name>.yaml``.

    Raises: ValueError when there is no such option or its target is not ``source: random_shape``."""
    path = Path(CONF_DIR, "model", f"{name}.yaml")
    if not path.is_file():
        known = sorted(p.stem for p in Path(CONF_DIR, "model").glob("*.yaml"))
        raise ValueError(f"experiment.models: no model option {name!r}; known: {', '.join(known)}")
    spec = OmegaConf.load(path).targets[0]
    if str(spec.get("source")) != "random_shape":
        raise ValueError(f"experiment.models: {name!r} is source {spec.get('source')}; the weight shapes are read "
                         "from random_shape configs (e.g. qwen35-4b-shape, nemotronh-4b-shape)")
    return spec


def _meta_model(spec):
    import transformers

    config = target_config(spec)
    with torch.device("meta"):
        return getattr(transformers, str(spec.model_class))._from_config(config)


def sibling_shapes(spec) -> list[LinearShape]:
    """The distinct sibling groups of a ``random_shape`` target that the CUDA-graph path may merge
    (:func:`specdec.fusion.merge_candidates`: linears of one module with one input width; whether
    they read one input is learnt at run time), each as one :class:`LinearShape` with its
    ``members``; ``names``: one per group, its modules' names joined by ``+`` (e.g.
    ``model.layers.3.self_attn.q_proj+k_proj+v_proj``)."""
    from specdec.fusion import merge_candidates

    model = _meta_model(spec)
    names = {id(m): n for n, m in model.named_modules()}
    shapes: dict[tuple, list[str]] = {}
    for group in merge_candidates(model):
        key = (tuple(m.out_features for m in group), group[0].in_features, group[0].bias is not None)
        first = names[id(group[0])]
        shapes.setdefault(key, []).append("+".join([first] + [names[id(m)].rsplit(".", 1)[-1] for m in group[1:]]))
    return [LinearShape(sum(Ns), K, tuple(found), bias, members=Ns) for (Ns, K, bias), found in shapes.items()]


def linear_shapes(spec) -> list[LinearShape]:
    """The distinct ``nn.Linear`` weight shapes of a ``random_shape`` target, in module order (the
    model is built on the meta device: no memory, no init)."""
    model = _meta_model(spec)
    shapes: dict[tuple[int, int, bool], list[str]] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            shapes.setdefault((mod.out_features, mod.in_features, mod.bias is not None), []).append(name)
    return [LinearShape(N, K, tuple(names), bias) for (N, K, bias), names in shapes.items()]


def validate(cfg: DictConfig) -> None:
    """The models, rows and repeats; that the kernel can run on the device.

    Raises: ValueError saying what is wrong."""
    from specdec.kernels.linear import MAX_ROWS

    exp = cfg.experiment
    if not exp.models:
        raise ValueError("experiment.models is empty: list conf/model options, e.g. [qwen35-4b-shape]")
    for name in exp.models:
        model_spec(str(name))
    if not exp.rows or any(not 1 <= int(m) <= MAX_ROWS for m in exp.rows):
        raise ValueError(f"experiment.rows must list M in [1, {MAX_ROWS}], got {list(exp.rows)}")
    if exp.max_weight_mib is not None and float(exp.max_weight_mib) <= 0:
        raise ValueError(f"experiment.max_weight_mib must be > 0 or null (all), got {exp.max_weight_mib}")
    if int(exp.reps) < 1 or int(exp.min_calls) < 1:
        raise ValueError(f"experiment.reps and experiment.min_calls must be >= 1, got {exp.reps}, {exp.min_calls}")
    device, _ = resolve_device(cfg)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("experiment=skinny_linear times a Triton kernel: run it on CUDA, or on the CPU through "
                         "Triton's interpreter (TRITON_INTERPRET=1, tiny shapes: experiment.models=[qwen35-tiny-shape])")


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.double(), ref.double()
    return ((a - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def _sweep_configs(N: int, K: int, dtype, sms: int):
    """The launches of :data:`SWEEP` for a ``[N, K]`` weight (block_n capped as the default caps it)."""
    from specdec.kernels.linear import SkinnyConfig, skinny_config, split_k_for

    cap = skinny_config(N, K, dtype, sms).block_n
    out = []
    for block_n, block_k, warps, stages, waves in SWEEP:
        block_n = min(block_n, cap)
        split = split_k_for(N, K, block_n, block_k, sms * waves)
        cfg = SkinnyConfig(block_n=block_n, block_k=block_k, split_k=split,
                           num_warps=warps, num_stages=stages)
        if cfg not in out:
            out.append(cfg)
    return out


def run(cfg: DictConfig, out_dir: Path) -> list[dict]:
    """Time every (model, weight shape, M); returns the records (also in ``out_dir``)."""
    from specdec.kernels.linear import grouped_skinny_linear, linear_ref, num_sms, skinny_config, skinny_linear

    from .common import RunRecords, progress_bar, provenance
    from .report import write_report

    exp = cfg.experiment
    device, dtype = resolve_device(cfg)
    cuda = device.type == "cuda"
    gen = torch.Generator().manual_seed(int(cfg.seed))
    rows = sorted({int(m) for m in exp.rows})
    reps, min_calls = int(exp.reps), int(exp.min_calls)
    copy_GBps = copy_bandwidth(device) / 1e9
    sms = num_sms(device)
    esize = torch.empty((), dtype=dtype).element_size()
    limit = float(exp.max_weight_mib) * (1 << 20) if exp.max_weight_mib is not None else math.inf
    models = {str(m): [s for s in linear_shapes(model_spec(str(m))) + (sibling_shapes(model_spec(str(m)))
                                                                        if exp.groups else [])
                       if s.N * s.K * esize <= limit] for m in exp.models}
    common = {"experiment": "skinny_linear", "device": str(device), **provenance(device),
              "dtype": str(dtype).replace("torch.", ""), "seed": int(cfg.seed), "copy_GBps": copy_GBps, "sms": sms,
              "config": OmegaConf.to_container(cfg, resolve=True)}
    log = RunRecords(out_dir, progress_bar(cfg, sum(len(s) for s in models.values()) * len(rows), "skinny_linear"))
    for model, shapes in models.items():
        for shape in shapes:
            N, K, Ns = shape.N, shape.K, shape.members or (shape.N,)
            wbytes = N * K * esize
            copies = max(1, min(4096, math.ceil(ROT_BYTES / wbytes))) if cuda else 1
            weights = [[(torch.randn(n, K, generator=gen) * K**-0.5).to(device, dtype) for n in Ns]
                       for _ in range(copies)]
            biases = [torch.randn(n, generator=gen).to(device, dtype) for n in Ns] if shape.bias else [None] * len(Ns)
            x_all = torch.randn(max(rows), K, generator=gen).to(device, dtype)
            launch = skinny_config(N, K, dtype, sms)
            if shape.members:  # a grouped launch never splits K
                launch = dataclasses.replace(launch, split_k=1)

            def kernel(x, ws, config=None):  # the kernel the decode path runs: a group merged, a weight alone
                if shape.members:
                    return grouped_skinny_linear(x, ws, None if biases[0] is None else biases, config=config)
                return [skinny_linear(x, ws[0], biases[0], config=config)]

            checks = {}
            if exp.check:
                M = max(rows)
                ys = kernel(x_all[:M], weights[0])
                ones = {i: kernel(x_all[i:i + 1], weights[0]) for i in sorted({0, M // 2, M - 1})}
                same = all(torch.equal(one[j][0], ys[j][i]) for i, one in ones.items() for j in range(len(Ns)))
                err = max(_rel(y, linear_ref(x_all[:M], w, b)) for y, w, b in zip(ys, weights[0], biases))
                checks = {"rel_err": err, "batch_invariant": same}
            passes = math.ceil(min_calls / copies)
            for M in rows:
                x = x_all[:M].contiguous()

                def timed(fn):
                    def calls():
                        for _ in range(passes):
                            for ws in weights:
                                fn(ws)
                    return time_in_graph(calls, passes * copies, device, reps)

                t_torch = timed(lambda ws: [F.linear(x, w, b) for w, b in zip(ws, biases)])
                t_kernel = timed(lambda ws: kernel(x, ws))
                nbytes = wbytes + (M * K + M * N + (N if shape.bias else 0)) * esize
                rec = {**common, "model": model, "weight": shape.label, "N": N, "K": K, "layers": len(shape.names),
                       "rows": M, "bytes": nbytes, "torch_us": t_torch * 1e6, "kernel_us": t_kernel * 1e6,
                       "torch_GBps": nbytes / t_torch / 1e9, "kernel_GBps": nbytes / t_kernel / 1e9,
                       "torch_pct_copy_bw": 100 * nbytes / t_torch / 1e9 / copy_GBps,
                       "kernel_pct_copy_bw": 100 * nbytes / t_kernel / 1e9 / copy_GBps,
                       "speedup": t_torch / t_kernel, "launch": launch.describe(), "copies": copies, **checks}
                if shape.members:
                    rec["group"] = "+".join(map(str, Ns))
                    rec["members_kernel_us"] = 1e6 * timed(lambda ws: [skinny_linear(x, w, b)
                                                                       for w, b in zip(ws, biases)])
                elif exp.sweep:
                    best = min(((timed(lambda ws, c=c: kernel(x, ws, c)), c)
                                for c in _sweep_configs(N, K, dtype, sms)), key=lambda tc: tc[0])
                    rec.update(best_us=best[0] * 1e6, best_launch=best[1].describe(), best_speedup=t_torch / best[0])
                log.add(rec, f"{model} {shape.label} M={M}: F.linear {rec['torch_us']:.1f} us "
                             f"({rec['torch_pct_copy_bw']:.0f}% copy BW), kernel {rec['kernel_us']:.1f} us "
                             f"({rec['kernel_pct_copy_bw']:.0f}%), x{rec['speedup']:.2f}")
            del weights
            if cuda:
                torch.cuda.empty_cache()
    log.close()
    title = (f"Skinny linear vs F.linear (cuBLAS): {device}, {str(dtype).replace('torch.', '')}, copy bandwidth "
             f"{copy_GBps:.0f} GB/s, {sms} SMs")
    write_report(log.records, log.out_dir, title)
    with open(Path(log.out_dir) / "summary.md", "a") as fh:
        fh.write("\n".join(["", "## Linear time of one forward (every layer's matrix of the shapes timed)", ""]
                           + forward_lines(log.records)) + "\n")
        if any("group" in r for r in log.records):
            fh.write("\n".join(["", "## Sibling groups of one forward: F.linear per member against one grouped launch",
                                 ""] + forward_lines(log.records, groups=True)) + "\n")
    return log.records


def forward_lines(records: list[dict], groups: bool = False) -> list[str]:
    """Per model and M: the sum over weight shapes of (layers x time), F.linear against the kernel;
    with ``groups``, over the sibling groups instead (F.linear per member against the grouped launch)."""
    records = [r for r in records if ("group" in r) == groups]
    lines = ["| model | M | F.linear ms | kernel ms | speedup |", "|---|---|---|---|---|"]
    for model in dict.fromkeys(r["model"] for r in records):
        for M in sorted({r["rows"] for r in records if r["model"] == model}):
            group = [r for r in records if (r["model"], r["rows"]) == (model, M)]
            t = sum(r["layers"] * r["torch_us"] for r in group) / 1e3
            k = sum(r["layers"] * r["kernel_us"] for r in group) / 1e3
            lines.append(f"| {model} | {M} | {t:.3f} | {k:.3f} | {t / k:.2f}x |")
    return lines
