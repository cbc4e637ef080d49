"""Reports: per-configuration means from records, the Markdown summary, a terminal table, plots.

One function, :func:`write_report`, turns records (any mix of experiments: a single run, or
every job of a ``--multirun`` sweep) into ``summary.md`` and the PNG plots; the numbers in the
summary are the means of the records' fields over each configuration's records (prompts,
repeats or jobs), so they can always be recomputed from ``results.jsonl``.

Under the title, a line says where and how the records were measured (device, date, command:
:func:`provenance_lines`). Plots: ``accept_hist.png`` (acceptance: accepted-length histogram per
drafter), ``rollback_time_vs_batch.png`` (rollback: commit + fold and whole SSM time per step,
per strategy), ``speedup_vs_batch.png`` (rollback: speedup per strategy; bench and adaptive:
decode speedup per strategy, drafter, acceptance and K), ``k_over_time.png`` (adaptive: the K
``num_speculative_tokens="auto"`` chose at each step).

An experiment appends its records to ``results.jsonl`` as it measures; ``python -m
specdec.experiments.report RUN_DIR`` rewrites ``summary.md`` and the plots from them (a run cut
short keeps what it finished).
"""

from __future__ import annotations

import datetime
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Column", "summarize", "recommend", "write_report", "write_summary", "print_table",
           "accept_histogram_plot", "k_over_time_plot", "legend_lines", "COLUMNS", "ROLLBACK_COLUMNS", "BENCH_COLUMNS",
           "ADAPTIVE_COLUMNS", "SERVE_COLUMNS", "SERVE_PERCENTILES", "SECTIONS", "serve_plot",
           "TERMINAL_WIDTH"]

#: the terminal tables' width; wider tables keep their key columns there, all columns go to summary.md
TERMINAL_WIDTH = 100


@dataclass(frozen=True)
class Column:
    """A summary column: the record ``key`` it averages, its ``title``, ``fmt`` (None: a yes/no
    column; :data:`TEXT`: the distinct values, joined), ``terminal`` (also in the terminal
    table), ``spread`` (the cell shows ``median (min-max)`` from the records' ``<key>_min`` /
    ``<key>_max``) and its ``legend`` line."""

    key: str
    title: str
    fmt: str | None
    terminal: bool = True
    spread: bool = False
    legend: str = ""


#: ``Column.fmt`` of a text column (decode path, store names): its distinct values, joined
TEXT = "text"


_REPEATS = ("median of `repeats` timed runs, min-max in parentheses")

#: acceptance columns
COLUMNS = (
    Column("mean_accepted_tokens", "mean accepted tokens", "{:.2f}",
           legend="tokens committed per verify step (one target forward) and sequence, the target's own bonus/"
                  "correction token included: plain decoding = 1.00"),
    Column("acceptance_rate", "acceptance rate", "{:.3f}",
           legend="accepted drafts / drafts proposed; only drafts actually proposed count (n-gram proposes "
                  "nothing when no n-gram matches), so mean accepted tokens is not 1 + K x acceptance rate"),
    Column("tokens_per_s", "tokens/s", "{:.1f}", terminal=False, spread=True,
           legend="speculative decoding, new tokens per second on the timed prompt(s) (the first "
                  f"`experiment.timed_prompts` of the set: their acceptance, not the table's mean); {_REPEATS}"),
    Column("plain_tokens_per_s", "plain tokens/s", "{:.1f}", terminal=False, spread=True,
           legend="specdec's own plain decoding (num_speculative_tokens=0, same engine, same prompts, same "
                  "process)"),
    Column("hf_tokens_per_s", "HF tokens/s", "{:.1f}", terminal=False, spread=True,
           legend="transformers' greedy generate() on the same prompts, same process"),
    Column("speedup", "speedup vs plain", "{:.2f}x", spread=True,
           legend="tokens/s / plain tokens/s, round by round (each round runs both once): the median of the "
                  "rounds' ratios, their min-max in parentheses"),
    Column("within_noise", "within noise", None,
           legend="yes: the speedup's min-max includes 1.00x; this run cannot tell speculative and plain apart"),
    Column("hf_speedup", "vs HF", "{:.2f}x", terminal=False, spread=True,
           legend="tokens/s / HF tokens/s, round by round: median (min-max)"),
    Column("exact", "exact", None, legend="every output equals HF's greedy output token for token"),
    Column("near_tie", "divergences at near-ties", None, terminal=False,
           legend="of the inexact outputs, those diverging where HF's top-2 logit margin < 0.25 (bf16/fp16 only)"),
)

ROLLBACK_COLUMNS = (
    Column("e2e_verify_ms", "verify ms/step", "{:.2f}", spread=True,
           legend="end to end: target forward + acceptance per verify step of the real generate() runs; "
                  + _REPEATS),
    Column("e2e_commit_ms", "commit ms/step", "{:.3f}",
           legend="end to end: the strategy's commit per verify step (replay: its fold included)"),
    Column("kernel_verify_us", "layer verify us", "{:.1f}", terminal=False,
           legend="kernel level: one SSM layer, the strategy's verify on synthetic inputs at the model's shape"),
    Column("kernel_commit_us", "layer commit us", "{:.1f}", terminal=False, legend="kernel level: commit, one layer"),
    Column("kernel_fold_us", "layer fold us", "{:.1f}", terminal=False, legend="kernel level: replay fold, one layer"),
    Column("ssm_ms_per_step", "SSM ms/step", "{:.3f}", spread=True,
           legend="kernel level: verify + commit + fold x the SSM layers; " + _REPEATS),
    Column("bytes_per_step_MB", "MB moved/step", "{:.3f}", terminal=False,
           legend="bytes the strategy moves per step (the cost model of specdec.experiments.kernel_timing) x "
                  "layers x batch"),
    Column("extra_MiB_per_seq", "extra MiB/seq", "{:.3f}", terminal=False,
           legend="the strategy's memory beyond the live state, all SSM layers, per sequence"),
    Column("max_batch", "max batch in budget", "{:.0f}", terminal=False,
           legend="the largest batch whose SSM state (live + extra, all SSM layers; weights and KV cache not "
                  "counted) fits the memory budget stated below"),
    Column("speedup", "speedup vs plain", "{:.2f}x",
           legend="median tokens/s / median tokens/s of specdec plain (num_speculative_tokens=0), same batch"),
    Column("within_noise", "within noise", None,
           legend="yes: the wall-time ranges of speculative and plain overlap"),
    Column("exact", "exact output", None, legend="output == HF greedy, token for token"),
    Column("state_exact", "exact state", None, terminal=False,
           legend="committed SSM state == HF's after the same tokens (rel. err < 1e-5 in fp32)"),
    Column("kernel_state_exact", "exact layer state", None, terminal=False,
           legend="kernel-level committed state == the fp32 reference"),
)

_DECODE = "new tokens / (wall - prefill): the decode loop alone (the prefill is the model's own forward)"

BENCH_COLUMNS = (
    Column("decode_tokens_per_s", "decode tokens/s", "{:.1f}", spread=True,
           legend=f"speculative decoding, {_DECODE}; {_REPEATS}"),
    Column("plain_decode_tokens_per_s", "plain decode tokens/s", "{:.1f}", terminal=False, spread=True,
           legend="the same for specdec's own plain decoding (num_speculative_tokens=0, same engine and decode "
                  "path), same batch, same process"),
    Column("decode_speedup", "decode speedup", "{:.2f}x",
           legend="median decode tokens/s / median plain decode tokens/s"),
    Column("tokens_per_s", "tokens/s", "{:.1f}", terminal=False, spread=True,
           legend=f"end to end (prefill included), new tokens per second; {_REPEATS}"),
    Column("plain_tokens_per_s", "plain tokens/s", "{:.1f}", terminal=False, spread=True,
           legend="end to end, specdec's own plain decoding, same batch, same process"),
    Column("speedup", "speedup vs plain", "{:.2f}x", terminal=False,
           legend="end to end: median tokens/s / median plain tokens/s"),
    Column("within_noise", "within noise", None,
           legend="yes: the wall-time ranges of speculative and plain overlap"),
    Column("hf_tokens_per_s", "HF tokens/s", "{:.1f}", terminal=False, spread=True,
           legend="transformers' greedy generate() (its default cache), end to end, same batch, same process"),
    Column("hf_speedup", "vs HF", "{:.2f}x", terminal=False, legend="median tokens/s / median HF tokens/s"),
    Column("decode_ms_per_step", "decode ms/step", "{:.2f}", terminal=False,
           legend="(wall - prefill) / verify steps, median of the repeats"),
    Column("plain_decode_ms_per_step", "plain ms/step", "{:.2f}", terminal=False,
           legend="the same for specdec plain (one token per step)"),
    Column("plain_floor_ms", "plain floor ms", "{:.2f}", terminal=False,
           legend="the bytes a plain step must move (weights once, of an untied input embedding table the rows looked up; "
                  "each row's SSM state and conv window read and written, "
                  "its keys and values over the mean context) / the copy bandwidth measured by the run"),
    Column("plain_at_floor", "plain at floor", "{:.0%}", terminal=False,
           legend="plain floor ms / plain ms/step (100%: at the memory floor)"),
    Column("ms_per_step", "ms/step", "{:.2f}", terminal=False, legend="wall time / verify steps, median"),
    Column("mean_accepted_tokens", "mean accepted tokens", "{:.2f}", legend=COLUMNS[0].legend),
    Column("draft_ms", "draft ms/step", "{:.3f}", terminal=False,
           legend="the drafter's proposal per verify step (specdec.Stats.draft_s / steps), median of the repeats"),
    Column("draft_floor_ms", "draft floor ms", "{:.3f}", terminal=False,
           legend="MTP: the bytes a proposal must read (MTPDrafter.proposal_bytes: its layers' weights, K reads "
                  "of the LM-head rows drafted over) / the copy bandwidth measured by the run"),
    Column("draft_vs_floor", "draft x floor", "{:.2f}x", terminal=False, legend="draft ms/step / draft floor ms"),
    Column("draft_share", "draft %", "{:.0%}", terminal=False,
           legend="share of the decode steps' time spent drafting (specdec.Stats, summed over the repeats)"),
    Column("verify_share", "verify %", "{:.0%}", terminal=False, legend="share verifying (target forward + acceptance)"),
    Column("rollback_share", "rollback %", "{:.0%}", terminal=False,
           legend="share in the strategy's commit (the replay fold included)"),
    Column("peak_gib", "peak GiB", "{:.1f}", terminal=False,
           legend="torch.cuda.max_memory_allocated over the timed runs, weights included"),
    Column("decode_path", "decode path", TEXT, terminal=False,
           legend="eager | static | cuda_graph (docs/design.md, \"Decoders and decode paths\")"),
    Column("diverged_rows", "diverged rows", "{:.0f}",
           legend="rows whose output differs from specdec plain's (first divergences and margins below)"),
    Column("near_tie", "divergences at near-ties", None, terminal=False,
           legend="every first divergence where plain decoding's top-2 logit margin is < 0.25, in bf16/fp16 (the "
                  "only divergence the exactness contract allows; never in fp32)"),
    Column("exact", "exact", None,
           legend="every row's output equals specdec plain's (K = 0, same engine and path) token for token"),
)

_BENCH = {c.key: c for c in BENCH_COLUMNS}

ADAPTIVE_COLUMNS = (
    _BENCH["decode_tokens_per_s"],
    Column("decode_speedup", "vs plain", "{:.2f}x", legend=_BENCH["decode_speedup"].legend),
    Column("vs_best_fixed", "auto / best fixed", "{:.2f}x",
           legend="auto's median decode tokens/s / the best fixed (K, strategy) cell's, same workload and batch"),
    Column("best_fixed", "best fixed", TEXT, legend="that cell"),
    Column("vs_worst_fixed_k", "auto / worst fixed K", "{:.2f}x", terminal=False,
           legend="auto's decode tokens/s / the worst fixed K's (its best strategy): on a workload where every "
                  "fixed K loses, auto beats each by at least this"),
    Column("mean_k", "mean K", "{:.2f}", legend="drafts asked for per step, over the last timed run's steps"),
    Column("rollback_used", "strategy run", TEXT, terminal=False,
           legend="the rollback strategy the steps ran (auto: the one rollback='auto' chose; its reason is in "
                  "results.jsonl)"),
    Column("predicted_tokens_per_s", "predicted tokens/s", "{:.1f}", terminal=False,
           legend="auto: the goodput its policy predicted for the steps it chose (expected tokens / predicted "
                  "step time, summed over the steps)"),
    Column("measured_tokens_per_s", "measured tokens/s", "{:.1f}", terminal=False,
           legend="auto: the tokens its steps committed / the steps' time (decode loop, bookkeeping included)"),
    Column("speculation_gain", "predicted gain", "{:.2f}", terminal=False,
           legend="auto: the median over the last timed run's steps of the predicted goodput of the best K > 0 over "
                  "plain decoding's when the step's K was chosen (speculation starts above 1 + max(min_gain, "
                  "hysteresis), or above 1 + min_gain for long enough (PolicySettings.hysteresis_sum; min_gain "
                  "shrinks above 8 rows), and stops when plain decoding beats the running K by more than "
                  "hysteresis, or by less for long enough); "
                  "results.jsonl has it per step, and the predicted against the measured step ms per K"),
    Column("calibration_s", "calibration s", "{:.3f}", terminal=False,
           legend="time measuring step costs inside the timed calls (auto's first call per batch measures; "
                  "the untimed warm-up takes it when experiment.warmup)"),
    _BENCH["mean_accepted_tokens"],
    _BENCH["diverged_rows"],
    _BENCH["exact"],
)

#: the latency percentiles of experiment=serve (record keys ``ttft_p<q>_ms``, ``tpot_p<q>_ms``)
SERVE_PERCENTILES = (50, 90, 99)

SERVE_COLUMNS = (
    Column("tokens_per_s", "tokens/s", "{:.1f}", spread=True,
           legend="generated tokens (each request's own, up to its budget or EOS) / the run's wall time, every "
                  "request arriving at its start (with experiment.request_rate: at Poisson times, the wall from the "
                  f"first arrival to the last request's finish); {_REPEATS}"),
    Column("vs_fixed_batches", "vs fixed batches", "{:.2f}x",
           legend="continuous batching's median tokens/s / generate() on fixed batches of the same size, same "
                  "drafter and strategy (runs without the prefix cache only: fixed batches have none)"),
    Column("vs_continuous_plain", "vs continuous plain", "{:.2f}x",
           legend="median tokens/s / continuous plain decoding's (num_speculative_tokens=0, same pool size, same "
                  "prefix-cache setting)"),
    Column("ttft_p50_ms", "TTFT p50 ms", "{:.1f}",
           legend="time to first token: from the request's arrival (the run's start; with experiment.request_rate "
                  "its Poisson arrival) to the host sync after its prefill (with request_rate, continuous runs: the "
                  "client's receipt of its first streamed token); percentiles over the requests of every repeat"),
    Column("ttft_p90_ms", "TTFT p90 ms", "{:.1f}", terminal=False, legend="its 90th percentile"),
    Column("ttft_p99_ms", "TTFT p99 ms", "{:.1f}", terminal=False, legend="its 99th percentile"),
    Column("ttft_mean_ms", "TTFT mean ms", "{:.1f}", terminal=False, legend="its mean"),
    Column("queue_wait_mean_ms", "wait before admission mean ms", "{:.1f}", terminal=False,
           legend="the part of the time to first token before the request's admission: from its arrival (the run's "
                  "start without experiment.request_rate) to the pool taking it (the wait for a free row, for the "
                  "step in flight and for a fuller admission; fixed batches: to its batch's generate() call), mean "
                  "over the requests; its p50 / p90 / p99 in the records"),
    Column("admission_to_first_token_mean_ms", "admission to first token mean ms", "{:.1f}", terminal=False,
           legend="the rest of it: the prompt forward (with the prefix cache's lookup and restore; a long prompt's "
                  "chunks with the steps between them), the first token's pick and, with request_rate, its receipt "
                  "by the client; a call's first admission also holds the call's set-up (placeholder prefill, "
                  "decode buffers, calibration), and fixed batches the whole batch's prefill; mean over the "
                  "requests, p50 / p90 / p99 in the records"),
    Column("tpot_p50_ms", "TPOT p50 ms", "{:.2f}",
           legend="time per output token after the first: (finished - first token) / (tokens - 1) per request "
                  "(fixed batches: a request finishes when its batch's generate() returns)"),
    Column("tpot_p90_ms", "TPOT p90 ms", "{:.2f}", terminal=False, legend="its 90th percentile"),
    Column("tpot_p99_ms", "TPOT p99 ms", "{:.2f}", terminal=False, legend="its 99th percentile"),
    Column("tpot_mean_ms", "TPOT mean ms", "{:.2f}", terminal=False, legend="its mean"),
    Column("mean_busy_rows", "busy rows", "{:.1f}", terminal=False,
           legend="rows holding a request (admitted, not finished), averaged over the run"),
    Column("mean_accepted_tokens", "mean accepted tokens", "{:.2f}", terminal=False, legend=COLUMNS[0].legend),
    Column("mean_k", "mean K", "{:.2f}", terminal=False,
           legend="drafts asked for per decode step, over the run's steps (num_speculative_tokens=auto chooses them "
                  "per step; the records' k_histogram counts the steps per K)"),
    Column("wall_s", "wall s", "{:.2f}", terminal=False, spread=True,
           legend=f"the run's wall time (with experiment.request_rate: from the first arrival to the last request's "
                  f"finish); {_REPEATS}"),
    Column("admission_s", "prefill s", "{:.2f}", terminal=False,
           legend="time in prefills (the first requests' and every admission's), summed over the run's calls "
                  "(with experiment.request_rate, continuous runs: also the loop's idle waits for arrivals)"),
    Column("step_ms", "step ms", "{:.2f}", terminal=False,
           legend="draft + verify + commit time per decode step (host time between the step's marks)"),
    Column("other_s", "other s", "{:.2f}", terminal=False,
           legend="the calls' wall time outside prefills and steps: host work between steps, calibration, captures"),
    Column("prompt_forwards_captured", "prompt captures", "{:.0f}", terminal=False,
           legend="prompt forwards of the timed runs that captured their bucket's CUDA graph (a bucket's second "
                  "use), holding up the decode loop meanwhile; experiment.rehearse or experiment.manager_warmup "
                  "pays them before the timed runs"),
    Column("manager_warmup_s", "manager warm-up s", "{:.2f}", terminal=False,
           legend="with experiment.manager_warmup: seconds of the managers' warmup() calls before start(), "
                  "untimed, summed over the timed passes (the grid, and with the prefix cache the sample prompts)"),
    Column("prefix_hit_rate", "prefix hit rate", "{:.2f}",
           legend="prompt tokens whose state the prefix cache served / prompt tokens looked up (last_stats.prefix_cache)"),
    Column("ttft_speedup_vs_no_prefix_cache", "TTFT gain from prefix cache", "{:.2f}x",
           legend="mean time to first token of the same run without prefix caching / with it"),
    Column("vs_no_prefix_cache", "tokens/s vs no prefix cache", "{:.2f}x", terminal=False,
           legend="median tokens/s / the same run's without prefix caching"),
    Column("decode_path", "decode path", TEXT, terminal=False, legend=_BENCH["decode_path"].legend),
    Column("diverged_requests", "diverged requests", "{:.0f}", terminal=False,
           legend="requests whose tokens differ from continuous plain decoding's"),
    Column("near_tie", "divergences at near-ties", None, terminal=False, legend=_BENCH["near_tie"].legend),
    Column("exact", "exact", None, legend="every request's tokens equal continuous plain decoding's"),
    Column("error", "error", TEXT, legend="why the run did not run (a setting the engine refuses)"),
)

KERNEL_COLUMNS = (
    Column("launches", "launches", "{:.0f}", legend="kernel launches per layer and step"),
    Column("us_per_step", "us/step", "{:.1f}",
           legend="device time per layer and step: median of the graph replays / steps per graph"),
    Column("vs_snapshot", "vs snapshot", "{:.2f}", legend="us/step / snapshot's"),
    Column("vs_baseline", "vs baseline", "{:.2f}", legend="us/step / the no-rollback update's"),
    Column("kernel_MB", "kernel MB", "{:.1f}", terminal=False, legend="bytes the kernels move per step, all rows"),
    Column("design_MB", "design MB", "{:.1f}", terminal=False,
           legend="the cost model's bytes per step (docs/design.md, \"The rollback cost model\"), all rows"),
    Column("GBps", "GB/s", "{:.0f}", terminal=False, legend="kernel bytes / time"),
    Column("pct_copy_bw", "% copy BW", "{:.0f}%", legend="GB/s / a measured device-to-device copy's"),
    Column("x_floor", "x floor", "{:.2f}", legend="time / (kernel bytes at copy bandwidth)"),
    Column("extra_MiB_per_seq", "extra MiB/seq", "{:.1f}", terminal=False,
           legend="the strategy's memory beyond the live state, all SSM layers of the bench model, per sequence"),
    Column("max_batch", "max batch", "{:.0f}", terminal=False,
           legend="largest batch whose SSM state (live + extra) fits experiment.memory_budget_gib"),
    Column("exact", "exact", None, legend="outputs and committed states == the fp32 reference (rel. RMS < 1e-4)"),
)

TREE_VERIFY_COLUMNS = (
    Column("nodes", "step tokens", "{:.0f}", legend="tokens (chain) or nodes (tree) verified in the step"),
    Column("verify_ms", "verify ms", "{:.2f}", spread=True,
           legend="the target's verify forward (all layers, LM head): median of experiment.steps timed steps, "
                  "min-max in parentheses"),
    Column("commit_ms", "commit ms", "{:.3f}", spread=True,
           legend="committing a depth-4 path (tree: path compaction + the strategy's commit)"),
    Column("vs_chain", "verify / chain", "{:.2f}x", legend="median verify ms / the chain's, same strategy and batch"),
    Column("peak_gib", "peak GiB", "{:.1f}", terminal=False,
           legend="torch.cuda.max_memory_allocated during the configuration, weights included"),
    Column("host_ops", "host ops", "{:.0f}", terminal=False,
           legend="profiled verify (experiment.profile): top-level torch ops dispatched"),
    Column("host_ms", "host ms", "{:.2f}", terminal=False,
           legend="profiled verify: summed host self time (profiler overhead included)"),
    Column("gpu_kernels", "GPU kernels", "{:.0f}", terminal=False, legend="profiled verify: GPU kernels launched"),
    Column("device_ms", "GPU busy ms", "{:.2f}", terminal=False, legend="profiled verify: summed kernel durations"),
)

NGRAM_COLUMNS = (
    Column("loop_ms", "per-row loop ms", "{:.3f}", spread=True,
           legend=f"specdec.drafters.ngram.propose_ngram_reference, one proposal; {_REPEATS}"),
    Column("batched_ms", "batched ms", "{:.3f}", spread=True, legend="NGramDrafter.propose_batched, one proposal"),
    Column("kernel_ms", "kernel ms", "{:.3f}", spread=True,
           legend="NGramDrafter.propose_kernel (one Triton launch), one proposal; Triton backend only"),
    Column("loop_over_batched", "loop / batched", "{:.1f}x", legend="median loop ms / median batched ms"),
    Column("within_noise", "within noise", None, legend="yes: the min-max ranges of loop and batched overlap"),
    Column("batched_over_kernel", "batched / kernel", "{:.1f}x", terminal=False, legend="median batched ms / median kernel ms"),
    Column("kernel_in_graph_ms", "kernel in a graph ms", "{:.4f}",
           legend="NGramDrafter.propose_kernel, experiment.graph_calls calls back to back in one CUDA graph, device "
                  "time per call (median of the replays): what the CUDA-graph decode path pays; on a CPU wall time"),
    Column("kernel_in_graph_over_plain_step", "in a graph, of a plain step", "{:.3f}",
           legend="kernel in a graph ms / experiment.plain_step_ms"),
    Column("search", "propose takes", TEXT, legend="the search NGramDrafter.propose runs here (NGramDrafter.search)"),
    Column("propose_over_plain_step", "of a plain step", "{:.3f}",
           legend="median ms of the search propose takes / experiment.plain_step_ms"),
    Column("rows_with_drafts", "rows with drafts", "{:.0f}", legend="rows where an n-gram matched"),
    Column("same_proposals", "same proposals", None, legend="every search proposes the same tokens and counts"),
)

SKINNY_LINEAR_COLUMNS = (
    Column("layers", "layers", "{:.0f}", legend="modules of the model with this weight shape"),
    Column("torch_us", "F.linear us", "{:.1f}",
           legend="cuBLAS (F.linear), device time per call in a CUDA graph over weights rotated past L2: median of "
                  "experiment.reps replays"),
    Column("kernel_us", "kernel us", "{:.1f}", legend="specdec.kernels.linear.skinny_linear, the same way (a sibling "
                                                      "group: one grouped_skinny_linear launch for all its members)"),
    Column("members_kernel_us", "skinny per member us", "{:.1f}", terminal=False,
           legend="a sibling group: skinny_linear once per member, the same way"),
    Column("torch_pct_copy_bw", "F.linear % copy BW", "{:.0f}%",
           legend="(weight + x + output bytes) / time, as a share of a measured device-to-device copy's GB/s"),
    Column("kernel_pct_copy_bw", "kernel % copy BW", "{:.0f}%", legend="the same for the kernel"),
    Column("kernel_GBps", "kernel GB/s", "{:.0f}", terminal=False, legend="the kernel's bytes / time"),
    Column("speedup", "speedup", "{:.2f}x", legend="F.linear us / kernel us"),
    Column("launch", "launch", TEXT, terminal=False,
           legend="the kernel's launch (skinny_config): block_n, block_k, K splits, warps, stages"),
    Column("best_speedup", "best sweep speedup", "{:.2f}x", terminal=False,
           legend="experiment.sweep: F.linear us / the fastest launch's us"),
    Column("best_launch", "best launch", TEXT, terminal=False, legend="experiment.sweep: that launch"),
    Column("rel_err", "rel. err", "{:.1e}", terminal=False,
           legend="relative RMS error against the fp32 reference at the largest M"),
    Column("batch_invariant", "batch-invariant", None, terminal=False,
           legend="rows of the largest-M call equal 1-row calls bit for bit"),
)

PREFILL_COLUMNS = (
    Column("scan_path", "scan path", TEXT, legend="what the scan ran as on this device: fla (flash-linear-attention), "
                                                  "torch (specdec's chunked SSD scan) or hf (transformers' mixer "
                                                  "forward)"),
    Column("prefill_ms", "prefill ms", "{:.1f}", spread=True, legend=f"HybridAdapter.prefill of the batch; {_REPEATS}"),
    Column("tokens_per_s", "tokens/s", "{:.0f}", spread=True, legend="batch x prompt tokens / prefill time"),
    Column("roof_ms", "roof ms", "{:.1f}", legend="2 x parameters (body, no embedding) x tokens at the device's "
                                                   "dense bf16 peak: a floor"),
    Column("x_roof", "x roof", "{:.1f}x", legend="prefill ms / roof ms"),
    Column("vs_default", "x default", "{:.3f}", legend="with experiment.switches: prefill ms over the default's "
                                                       "(the default's row, 1.000), timed round by round"),
    Column("peak_gib", "peak GiB", "{:.1f}", terminal=False,
           legend="torch.cuda.max_memory_allocated over the runs (with switches: every setting's), weights included"),
    Column("logits_rel_err_vs_hf", "logits vs hf", "{:.1e}", terminal=False,
           legend="relative error of the last position's logits against the hf scan's"),
    Column("prompt_bucket", "bucket", TEXT, terminal=False,
           legend="the [rows, width] the static / cuda_graph prompt path ran the batch at"),
    Column("logits_rel_err_vs_eager", "logits vs eager", "{:.1e}", terminal=False,
           legend="relative error of the last position's logits against the eager prompt path's"),
    Column("prompt_graph_error", "capture error", TEXT, terminal=False,
           legend="why the cuda_graph prompt path ran without a graph, if it did"),
    Column("logits_rel_err_vs_default", "logits vs default", "{:.1e}", terminal=False,
           legend="with experiment.switches: relative error of the last position's logits against the default's"),
)

_OK = Column("ok", "ok", None, legend="the check's condition holds for this row")

CHECK_COLUMNS = {
    "rollback_on_device": (
        Column("decode_path", "decode path", TEXT),
        Column("cache_tensors", "cache tensors", "{:.0f}", legend="tensors the cache holds (KV, conv, every store)"),
        Column("off_device", "off the device", "{:.0f}", legend="of them, tensors not on the model's device"),
        Column("stores", "store tensors", TEXT, terminal=False, legend="the rollback store's tensors"),
        Column("dtoh_per_step", "D2H copies/step", "{:.2f}",
               legend="device-to-host copies per decode step (torch.profiler: a long run minus a short one, over "
                      "the difference in steps); CUDA only"),
        Column("syncs_per_step", "host syncs/step", "{:.2f}", terminal=False, legend="the same for host syncs"),
        Column("draft_ms", "draft ms", "{:.2f}", terminal=False, legend="specdec.Stats.draft_s of the run"),
        Column("verify_ms", "verify ms", "{:.2f}", terminal=False, legend="specdec.Stats.verify_s"),
        Column("rollback_ms", "rollback ms", "{:.2f}", legend="specdec.Stats.rollback_s, timed apart"),
        _OK,
    ),
    "step_cost": (
        Column("plain_step_ms", "plain ms/step", "{:.3f}", spread=True,
               legend=f"specdec plain (K = 0), same decode path: (wall - prefill) / steps; {_REPEATS}"),
        Column("step_ms", "speculative ms/step", "{:.3f}", spread=True, legend="the same, speculative"),
        Column("ratio", "ratio", "{:.2f}", legend="median speculative step / median plain step, same batch"),
        Column("bound", "bound", "{:.2f}", legend="1 + K/4"),
        Column("decode_path", "decode path", TEXT),
        Column("mean_accepted_tokens", "mean accepted tokens", "{:.2f}", terminal=False),
        Column("tokens_gain", "tokens/s gain", "{:.2f}x", terminal=False,
               legend="mean accepted tokens / ratio: the expected decode speedup"),
        _OK,
    ),
    "memory_budget": (
        Column("live_MiB", "live MiB/seq", "{:.3f}", terminal=False, legend="live fp32 SSM state, as run"),
        Column("extra_MiB", "extra MiB/seq", "{:.3f}",
               legend="the strategy's store beyond the live state (measured allocations), as run"),
        Column("conv_MiB", "conv MiB/seq", "{:.4f}", terminal=False, legend="conv windows, as run"),
        Column("kv_KiB_per_token", "KV KiB/token", "{:.2f}", terminal=False, legend="KV cache per token, as run"),
        Column("max_batch", "max batch", "{:.0f}",
               legend="budget / (live + extra + conv + KV at experiment.context_tokens), as run"),
        Column("extra_MiB_full", "extra MiB/seq (full)", "{:.2f}",
               legend="extra scaled to the bench shape's full depth"),
        Column("max_batch_full", "max batch (full)", "{:.0f}", legend="max batch at full depth"),
        Column("max_batch_ssm_full", "max batch, SSM only (full)", "{:.0f}", terminal=False,
               legend="budget / (live + extra SSM state) at full depth"),
    ),
    "fp32_state": (
        Column("state_tensors", "state tensors", TEXT, legend="the store's floating tensors checked (one layer)"),
        Column("ok", "fp32", None, legend="every stored SSM state and the committed state are fp32"),
    ),
}

#: means the plots and the recommendation use, not shown in the table
HIDDEN_COLUMNS = (
    Column("rollback_ms_per_step", "rollback ms/step", "{:.3f}"),
    Column("e2e_step_ms", "verify + commit ms/step", "{:.3f}"),
)

#: experiment -> (group keys, columns, count column title)
SECTIONS = {
    "acceptance": (("model", "drafter", "rollback", "num_speculative_tokens"), COLUMNS, "prompts"),
    "rollback": (("model", "drafter", "rollback", "batch", "num_speculative_tokens"), ROLLBACK_COLUMNS, "runs"),
    "bench": (("model", "drafter", "acceptance", "rollback", "batch", "num_speculative_tokens"), BENCH_COLUMNS,
              "runs"),
    "adaptive": (("model", "acceptance", "batch", "rollback", "num_speculative_tokens"), ADAPTIVE_COLUMNS, "runs"),
    "serve": (("model", "run", "drafter", "acceptance", "rollback", "batch", "num_speculative_tokens",
               "prefix_caching"), SERVE_COLUMNS,
              "runs"),
    "kernels": (("op", "batch", "num_speculative_tokens", "rollback", "launch"), KERNEL_COLUMNS, "runs"),
    "tree_verify": (("model", "decode_path", "rollback", "batch", "variant"), TREE_VERIFY_COLUMNS, "runs"),
    "ngram_proposal": (("batch", "width"), NGRAM_COLUMNS, "runs"),
    "skinny_linear": (("model", "weight", "rows"), SKINNY_LINEAR_COLUMNS, "runs"),
    "prefill": (("model", "batch", "prompt_tokens", "scan", "prompt_path"), PREFILL_COLUMNS, "runs"),
    "checks.rollback_on_device": (("model", "rollback"), CHECK_COLUMNS["rollback_on_device"], "runs"),
    "checks.step_cost": (("model", "batch", "rollback"), CHECK_COLUMNS["step_cost"], "runs"),
    "checks.memory_budget": (("model", "rollback"), CHECK_COLUMNS["memory_budget"], "runs"),
    "checks.fp32_state": (("model", "rollback"), CHECK_COLUMNS["fp32_state"], "runs"),
}
#: column titles of the group keys
KEY_TITLES = {"num_speculative_tokens": "K", "prefix_caching": "prefix caching", "rehearse": "rehearsed",
              "manager_warmup": "manager warm-up"}
#: config fields that become group keys when they differ between records (multirun sweeps)
SWEPT = ("max_new_tokens", "prompt_set", "dtype", "device", "seed", "request_rate", "rehearse", "manager_warmup",
         "overlap", "switch")


def _experiment(r: dict) -> str:
    return r.get("experiment", "acceptance")


def _key_value(r: dict, k: str):
    """A record's value of group key ``k``; devices are grouped by type (``cuda:1`` -> ``cuda``), so
    the processes of one multi-GPU run share rows."""
    v = r.get(k)
    if k == "device" and isinstance(v, str):
        return v.split(":")[0]
    return v


def _keys_for(records: list[dict], base) -> tuple:
    extra = tuple(k for k in SWEPT if len({str(_key_value(r, k)) for r in records}) > 1)
    return tuple(base) + extra


def _mean(rs, key):
    vals = [float(r[key]) for r in rs if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(records: list[dict], keys=None, columns=None) -> list[dict]:
    """One row per distinct ``keys`` (default: the experiment's), in first-seen order.

    Numeric columns: the mean over the group's records that have a value (None when none
    has); a spread column also gets ``<key>_min`` / ``<key>_max`` (means likewise). Yes/no
    columns: "yes" when all are true, "no" when none is, else "k/n" (None when none has a value). ``prompts``: the
    group's record count. ``accept_histogram``: summed when present.
    """
    if not records:
        return []
    exp = _experiment(records[0])
    base, cols, _ = SECTIONS.get(exp, SECTIONS["acceptance"])
    keys = tuple(keys) if keys is not None else _keys_for(records, base)
    columns = tuple(columns if columns is not None else cols) + HIDDEN_COLUMNS
    groups: dict = defaultdict(list)
    for r in records:
        groups[tuple(_key_value(r, k) for k in keys)].append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(zip(keys, key))
        row["prompts"] = len(rs)
        for c in columns:
            vals = [r[c.key] for r in rs if r.get(c.key) is not None]
            if not vals:
                row[c.key] = None
            elif c.fmt is None:
                n = sum(bool(v) for v in vals)
                row[c.key] = "yes" if n == len(vals) else "no" if n == 0 else f"{n}/{len(vals)}"
            elif c.fmt == TEXT:
                row[c.key] = ", ".join(dict.fromkeys(str(v) for v in vals))
            else:
                row[c.key] = _mean(rs, c.key)
            if c.spread:
                row[f"{c.key}_min"], row[f"{c.key}_max"] = _mean(rs, f"{c.key}_min"), _mean(rs, f"{c.key}_max")
        hists = [r["accept_histogram"] for r in rs if r.get("accept_histogram")]
        if hists:
            hist = [0] * max(len(h) for h in hists)
            for h in hists:
                for i, v in enumerate(h):
                    hist[i] += v
            row["accept_histogram"] = hist
        rows.append(row)
    return rows


def _present(rows, columns):
    return [c for c in columns if any(row.get(c.key) is not None for row in rows)]


def _fmt(value, fmt) -> str:
    if value is None:
        return "-"
    return str(value) if fmt in (None, TEXT) else fmt.format(value)


def _cell(row, c: Column) -> str:
    text = _fmt(row.get(c.key), c.fmt)
    lo, hi = row.get(f"{c.key}_min"), row.get(f"{c.key}_max")
    if c.spread and lo is not None and hi is not None and lo != hi and row.get(c.key) is not None:
        text += f" ({c.fmt.format(lo)}-{c.fmt.format(hi)})"
    return text


def _key_cell(value) -> str:
    return "-" if value is None else str(value)


def _cells(row, keys, columns, count=True):
    return ([_key_cell(row[k]) for k in keys] + ([str(row["prompts"])] if count else [])
            + [_cell(row, c) for c in columns])


def _table_lines(rows, keys, columns, count_title) -> list[str]:
    head = [KEY_TITLES.get(k, k) for k in keys] + [count_title] + [c.title for c in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(row, keys, columns)) + " |" for row in rows]
    return lines


def legend_lines(columns, markdown: bool = True) -> list[str]:
    """One line per column with a legend: ``- `title`: legend`` (Markdown) or ``  title: legend``."""
    return [f"- `{c.title}`: {c.legend}" if markdown else f"  {c.title}: {c.legend}" for c in columns if c.legend]


def write_summary(path: Path, title: str, rows: list[dict], keys=None, columns=COLUMNS, count_title="prompts") -> None:
    """A Markdown file: ``# title``, the table of ``rows`` (from :func:`summarize`) and the legend."""
    keys = keys or [k for k in SECTIONS["acceptance"][0] if rows and k in rows[0]]
    columns = _present(rows, columns)
    Path(path).write_text("\n".join([f"# {title}", ""] + _table_lines(rows, keys, columns, count_title)
                                    + ["", "Columns:", ""] + legend_lines(columns)) + "\n")


def _console(width: int | None = None):
    from rich.console import Console

    return Console(width=width or min(TERMINAL_WIDTH, shutil.get_terminal_size((TERMINAL_WIDTH, 24)).columns),
                   soft_wrap=False)


def _print_rows(title: str, key_titles: list[str], metric_titles: list[str], rows: list[tuple]) -> list[str]:
    """A terminal table at most :data:`TERMINAL_WIDTH` wide: ``rows`` are ``(key cells, metric
    cells with spreads, metric cells without)``. Key columns whose value is the same in every
    row move into the title; spreads are shown only where the table still fits; where even
    without them it does not, the last metric columns (not ``exact``) are left out and named.
    Returns the metric titles shown."""
    from rich import box
    from rich.table import Table

    console = _console()
    keep = [i for i in range(len(key_titles)) if len(rows) < 2 or len({r[0][i] for r in rows}) > 1]
    same = [i for i in range(len(key_titles)) if i not in keep]
    if same and rows:
        title += " | " + ", ".join(f"{key_titles[i]}={rows[0][0][i]}" for i in same)

    shown = list(range(len(metric_titles)))

    def natural_width(which: int) -> int:  # every cell on one line, headers wrapped at spaces, 3 for padding
        cols = [[key_titles[i]] + [r[0][i] for r in rows] for i in keep]
        cols += [[max(metric_titles[j].split(), key=len, default="")] + [r[which][j] for r in rows] for j in shown]
        return sum(max(len(c) for c in col) + 3 for col in cols)

    which = 1 if natural_width(1) <= console.width else 2
    left_out = []  # the last metric columns, where even without spreads they would not fit (cut, not garbled)
    while natural_width(which) > console.width and len(shown) > 1:  # (the exactness verdict stays)
        drop = next((j for j in reversed(shown) if metric_titles[j] != "exact"), shown[-1])
        shown.remove(drop)
        left_out.insert(0, metric_titles[drop])
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
    for i in keep:
        table.add_column(key_titles[i], justify="left", no_wrap=True)
    for j in shown:  # headers wrap at spaces
        table.add_column(metric_titles[j], justify="right")
    for r in rows:
        table.add_row(*[r[0][i] for i in keep], *[r[which][j] for j in shown])
    console.print(table)
    if left_out:
        console.print(f"(not shown at this width, in summary.md: {', '.join(left_out)})", soft_wrap=True)
    return [metric_titles[j] for j in shown]


def print_table(title: str, rows: list[dict], keys=None, columns=COLUMNS, count_title="prompts") -> list:
    """The key columns on the terminal, at most :data:`TERMINAL_WIDTH` wide (``summary.md`` has
    them all): columns marked ``terminal``; group keys with one value in every row go into the
    title; spreads only where the table still fits."""
    keys = list(keys or [k for k in SECTIONS["acceptance"][0] if rows and k in rows[0]])
    shown = [c for c in _present(rows, columns) if c.terminal]
    titles = _print_rows(title, [KEY_TITLES.get(k, k) for k in keys], [c.title for c in shown],
                         [([_key_cell(row[k]) for k in keys], [_cell(row, c) for c in shown],
                           [_fmt(row.get(c.key), c.fmt) for c in shown]) for row in rows])
    return [c for c in shown if c.title in titles]


# ------------------------------------------------------------------------ recommendation

_BASIS = {"kernel": ("ssm_ms_per_step", "kernel-level SSM time per step (all SSM layers)"),
          "end_to_end": ("e2e_step_ms", "end-to-end verify + commit time per step")}


def recommend(records: list[dict], basis: str | None = None) -> tuple[list[dict], str]:
    """The fastest strategy per grid point of rollback records.

    Per (model, drafter, batch, K, swept keys): among the strategies whose output and states
    were exact (or not checked), the one with the least time per step on ``basis`` (``kernel``:
    ``ssm_ms_per_step``; ``end_to_end``: ``e2e_step_ms``; default: the records'
    ``recommend_by``, falling back to whichever was measured). Returns (rows, basis text); a
    row has ``fastest``, ``ms_per_step``, ``runner_up``, ``runner_up_x`` (its time / the
    fastest's), ``snapshot_x`` (snapshot's time / the fastest's) and ``within_noise`` (the
    runner-up's fastest repeat is no slower than the fastest's slowest: the measurement does
    not rank them; None without spreads).
    """
    recs = [r for r in records if _experiment(r) == "rollback"]
    if not recs:
        return [], ""
    basis = basis or recs[0].get("recommend_by") or "kernel"
    col, text = _BASIS[basis]
    if not any(r.get(col) is not None for r in recs):
        basis = "end_to_end" if basis == "kernel" else "kernel"
        col, text = _BASIS[basis]
    rows = summarize(recs)
    keys = [k for k in _keys_for(recs, SECTIONS["rollback"][0]) if k != "rollback"]
    groups: dict = defaultdict(list)
    for row in rows:
        groups[tuple(row[k] for k in keys)].append(row)
    out = []
    for key, rs in groups.items():
        ok = [r for r in rs if r.get(col) is not None
              and all(r.get(c) in (None, "yes") for c in ("exact", "state_exact", "kernel_state_exact"))]
        if not ok:
            continue
        ok.sort(key=lambda r: r[col])
        best = ok[0]
        snap = next((r for r in ok if r["rollback"] == "snapshot"), None)
        second = ok[1] if len(ok) > 1 else None
        noise = None
        spread = best.get(f"{col}_min") is not None and best[f"{col}_min"] < best.get(f"{col}_max")
        if second is not None and spread and second.get(f"{col}_min") is not None:  # one repeat: no spread
            noise = second[f"{col}_min"] <= best[f"{col}_max"]
        out.append({**dict(zip(keys, key)), "fastest": best["rollback"], "ms_per_step": best[col],
                    "within_noise": noise,
                    "runner_up": ok[1]["rollback"] if len(ok) > 1 else None,
                    "runner_up_x": ok[1][col] / best[col] if len(ok) > 1 and best[col] > 0 else None,
                    "snapshot_x": snap[col] / best[col] if snap is not None and best[col] > 0 else None})
    return out, text


_RECOMMEND_FIELDS = ("fastest", "ms_per_step", "within_noise", "runner_up", "runner_up_x", "snapshot_x")


def _recommendation_table(records) -> tuple[list[str], list[list[str]], str]:
    rows, text = recommend(records)
    if not rows:
        return [], [], ""
    keys = [k for k in rows[0] if k not in _RECOMMEND_FIELDS]
    head = [KEY_TITLES.get(k, k) for k in keys] + ["fastest", "ms/step", "runner-up", "runner-up / fastest",
                                                    "within noise", "snapshot / fastest"]
    body = [[str(r[k]) for k in keys] + [r["fastest"], f"{r['ms_per_step']:.3f}", r["runner_up"] or "-",
                                         _fmt(r["runner_up_x"], "{:.2f}x"),
                                         "-" if r["within_noise"] is None else ("yes" if r["within_noise"] else "no"),
                                         _fmt(r["snapshot_x"], "{:.2f}x")] for r in rows]
    return head, body, text


def _recommendation_lines(records) -> list[str]:
    head, body, text = _recommendation_table(records)
    if not head:
        return []
    return (["", "## Recommendation", "", f"Fastest exact strategy per grid point, by {text}; `within noise`: yes "
             "where the runner-up's repeats overlap the fastest's, so this run does not rank the two.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            + ["| " + " | ".join(cells) + " |" for cells in body])


def _print_recommendation(records) -> None:
    head, body, text = _recommendation_table(records)
    if not head:
        return
    n_keys = len(head) - 6
    _print_rows(f"Fastest exact strategy per grid point, by {text}", head[:n_keys], head[n_keys:],
                [(cells[:n_keys], cells[n_keys:], cells[n_keys:]) for cells in body])


def _budget_text(r: dict) -> str:
    gib, source = r.get("memory_budget_gib"), r.get("memory_budget_source")
    if gib is None:
        return ""
    if source == "config":
        return f"{gib:.1f} GiB (experiment.memory_budget_gib: a budget you set, not this machine's memory)"
    return f"{gib:.1f} GiB ({source})"


def _rollback_notes(records) -> list[str]:
    """The SSM shape / S / I / memory budget behind the rollback table."""
    lines = [""]
    seen = set()
    for r in records:
        if r.get("ssm_shape") is None:
            continue
        key = (r["model"], r["ssm_shape"])
        if key in seen:
            continue
        seen.add(key)
        I_vals = sorted({r2.get("input_bytes_per_token") for r2 in records
                         if r2["model"] == r["model"] and r2.get("input_bytes_per_token")})
        budget = _budget_text(r)
        lines.append(f"- {r['model']}: SSM layers {r['ssm_shape']}; S = {r['state_bytes'] / 1024:.1f} KiB per layer "
                     f"and sequence (fp32), I = {', '.join(str(i) for i in I_vals)} B per token"
                     + (f"; `max batch in budget` uses {budget}" if budget else ""))
    return lines if len(lines) > 1 else []


# ------------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_subtitle(records: list[dict]) -> str:
    """``<models> | <devices> | <date>``: what every plot's title names."""
    models = ", ".join(dict.fromkeys(str(r.get("model")) for r in records))
    devices = ", ".join(dict.fromkeys(str(_key_value(r, "device")) for r in records))
    return f"{models} | {devices} | {datetime.date.today().isoformat()}"


def _legend_outside(ax) -> None:
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _save(fig, plt, path) -> None:
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def accept_histogram_plot(records: list[dict], path: Path) -> None:
    """Accepted-length histogram per drafter (share of verify steps that accepted n drafts)."""
    per = defaultdict(list)
    for r in records:
        if r.get("accept_histogram"):
            per[(r["model"], r["drafter"])].append(r["accept_histogram"])
    if not per:
        return
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(per)
    for i, ((model, drafter), hists) in enumerate(sorted(per.items())):
        n = max(len(h) for h in hists)
        tot = [sum(h[j] for h in hists if j < len(h)) for j in range(n)]
        s = sum(tot) or 1
        ax.bar([j - 0.4 + (i + 0.5) * width for j in range(n)], [t / s for t in tot], width,
               label=f"{model} / {drafter}")
    ax.set_xlabel("drafts accepted in a verify step")
    ax.set_ylabel("share of steps")
    ax.set_title(f"Accepted length per drafter\n{plot_subtitle(records)}", fontsize=10)
    _legend_outside(ax)
    _save(fig, plt, path)


_STYLES = ("-o", "--s", ":^", "-.v", "-D", "--x")


_KEY_LABELS = {"num_speculative_tokens": "K", "acceptance": "a"}


def _lines_vs_batch(ax, rows, col, ylabel, title, scale=1.0, style_keys=("num_speculative_tokens",)):
    """A line per strategy (colour) and per distinct value of ``style_keys`` (line style); shaded:
    the repeats' min-max where the rows have it."""
    strategies = list(dict.fromkeys(r["rollback"] for r in rows))
    styles = sorted({tuple(r.get(k) for k in style_keys) for r in rows}, key=str)
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    drawn = False
    for s in strategies:
        for i, style in enumerate(styles):
            mine = [r for r in rows if r["rollback"] == s and tuple(r.get(k) for k in style_keys) == style
                    and r.get(col) is not None]
            pts = sorted((r["batch"], r[col] * scale, r.get(f"{col}_min"), r.get(f"{col}_max")) for r in mine)
            if pts:
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                label = ", ".join([s] + [f"{_KEY_LABELS.get(k, k)}={v}" for k, v in zip(style_keys, style)
                                         if v is not None])
                ax.plot(xs, ys, _STYLES[i % len(_STYLES)], color=colors[s], label=label)
                if all(p[2] is not None and p[3] is not None for p in pts):  # the repeats' min-max
                    ax.fill_between(xs, [p[2] * scale for p in pts], [p[3] * scale for p in pts], color=colors[s],
                                    alpha=0.12, lw=0)
                drawn = True
    batches = sorted({r["batch"] for r in rows})
    if len(batches) > 1 and batches[0] > 0 and batches[-1] / batches[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    return drawn


def rollback_time_plot(rows: list[dict], path: Path, subtitle: str = "") -> None:
    """Rollback (commit + fold) and whole SSM time per step vs batch, a line per strategy and K
    (shaded: the repeats' min-max where measured)."""
    kernel = any(r.get("rollback_ms_per_step") is not None for r in rows)
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if kernel:
        _lines_vs_batch(axes[0], rows, "rollback_ms_per_step", "ms per step", "commit + fold, all SSM layers (kernel level)")
        drawn = _lines_vs_batch(axes[1], rows, "ssm_ms_per_step", "ms per step", "verify + commit + fold, all SSM layers")
    else:
        _lines_vs_batch(axes[0], rows, "e2e_commit_ms", "ms per step", "commit (+ fold), end to end")
        drawn = _lines_vs_batch(axes[1], rows, "e2e_step_ms", "ms per step", "verify + commit, end to end")
    if drawn:
        _legend_outside(axes[1])
    fig.suptitle(f"Rollback time vs batch, per strategy\n{subtitle}", fontsize=11)
    fig.tight_layout()
    _save(fig, plt, path)


def speedup_plot(rows: list[dict], path: Path, subtitle: str = "") -> None:
    """Speedup over specdec's plain decoding vs batch per strategy (shaded: where measured, the
    speculative runs' min-max over the plain median); kernel-level runs: vs snapshot."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if any(r.get("speedup") is not None for r in rows):
        drawn = _lines_vs_batch(ax, rows, "speedup", "speedup (x)", "speedup over specdec plain (K = 0)")
    else:  # kernel-level only: SSM time of snapshot / the strategy's, per (batch, K)
        snap = {(r["model"], r["batch"], r["num_speculative_tokens"]): r.get("ssm_ms_per_step") for r in rows
                if r["rollback"] == "snapshot"}
        rel = []
        for r in rows:
            s = snap.get((r["model"], r["batch"], r["num_speculative_tokens"]))
            if s and r.get("ssm_ms_per_step"):
                rel.append({**r, "vs_snapshot": s / r["ssm_ms_per_step"]})
        drawn = _lines_vs_batch(ax, rel, "vs_snapshot", "speedup (x)", "SSM time per step: snapshot / strategy "
                                "(kernel level)")
    ax.axhline(1.0, color="grey", lw=0.8)
    if drawn:
        _legend_outside(ax)
    if subtitle:
        ax.set_title(f"{ax.get_title()}\n{subtitle}", fontsize=10)
    _save(fig, plt, path)


def decode_speedup_plot(rows: list[dict], path: Path, subtitle: str = "") -> None:
    """Bench: decode speedup over specdec plain vs batch, a line per strategy, drafter, acceptance
    and K (a panel per model)."""
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model]
        drawn = _lines_vs_batch(ax, mine, "decode_speedup", "decode speedup (x)", model,
                                style_keys=("drafter", "acceptance", "num_speculative_tokens"))
        ax.axhline(1.0, color="grey", lw=0.8)
        if drawn:
            _legend_outside(ax)
    fig.suptitle(f"Decode speedup over specdec plain (K = 0)\n{subtitle}", fontsize=11)
    fig.tight_layout()
    _save(fig, plt, path)


def k_over_time_plot(records: list[dict], path: Path) -> None:
    """The K that ``num_speculative_tokens="auto"`` chose at each step (the records' ``k_per_step``),
    a panel per model, a line per workload (acceptance) and batch."""
    auto = [r for r in records if r.get("k_per_step")]
    if not auto:
        return
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in auto))
    fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.2), squeeze=False)
    for ax, model in zip(axes[0], models):
        for i, r in enumerate(r for r in auto if r["model"] == model):
            ks = r["k_per_step"]
            ax.step(range(1, len(ks) + 1), ks, where="post", color=f"C{i}",
                    label=f"a={r.get('acceptance')}, batch {r['batch']} ({r.get('rollback_used')})")
        ax.set_xlabel("decode step")
        ax.set_ylabel("K chosen")
        ax.set_title(model, fontsize=10)
        _legend_outside(ax)
    fig.suptitle(f"num_speculative_tokens='auto': K per step\n{plot_subtitle(auto)}", fontsize=11)
    fig.tight_layout()
    _save(fig, plt, path)


def serve_plot(records: list[dict], path: Path) -> None:
    """Serving: per run (one bar each), throughput, time to first token and time per output token
    at p50 / p90 / p99 (a panel each; a row of panels per model). Runs that failed are left out."""
    runs = [r for r in records if r.get("tokens_per_s") is not None]
    if not runs:
        return
    plt = _plt()
    models = list(dict.fromkeys(r["model"] for r in runs))
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    for row, model in zip(axes, models):
        mine = [r for r in runs if r["model"] == model]
        labels = ["\n".join([r["run"].replace("_", " "), r["drafter"]
                              + (f" a={r['acceptance']}" if r.get("acceptance") is not None else "")]
                             + ([r["rollback"]] if r["rollback"] != "none" else [])) for r in mine]
        xs = list(range(len(mine)))
        row[0].bar(xs, [r["tokens_per_s"] for r in mine], color=[f"C{i}" for i in xs])
        row[0].set_ylabel("tokens/s")
        row[0].set_title(f"{model}: throughput", fontsize=10)
        for ax, name, unit in ((row[1], "ttft", "time to first token (ms)"),
                               (row[2], "tpot", "time per output token (ms)")):
            width = 0.8 / len(SERVE_PERCENTILES)
            for j, q in enumerate(SERVE_PERCENTILES):
                ax.bar([x - 0.4 + (j + 0.5) * width for x in xs], [r.get(f"{name}_p{q}_ms") or 0.0 for r in mine],
                       width, label=f"p{q}", color=f"C{j}")
            ax.set_ylabel(unit)
            ax.set_title(f"{model}: {unit.split(' (')[0]}", fontsize=10)
            ax.legend(fontsize=7)
        for ax in row:
            ax.set_xticks(xs)
            ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    fig.suptitle(f"Serving: continuous batching, fixed batches, plain decoding\n{plot_subtitle(runs)}", fontsize=11)
    fig.tight_layout()
    _save(fig, plt, path)


# ------------------------------------------------------------------------------- report


#: printed under a table whose records ran on a CPU and carry speed columns
CPU_NOTE = ("On a CPU these small models are overhead-bound: a draft or a verify forward costs about a plain "
            "step, so what a CPU shows is exactness and acceptance; speed is measured on GPUs (BENCH.md).")
#: ... followed by this where the table has the column
NOISE_NOTE = " Read a speed column only where `within noise` is no."


def cpu_note(columns) -> str:
    """:data:`CPU_NOTE`, with :data:`NOISE_NOTE` where ``columns`` include ``within_noise``."""
    return CPU_NOTE + (NOISE_NOTE if any(c.key == "within_noise" for c in columns) else "")


def provenance_lines(records: list[dict]) -> list[str]:
    """Where and how the records were measured: ``Device: ...; date ...; command: `...` `` from
    the records' ``device_name``, ``date`` and ``command`` fields (distinct values joined);
    empty when they have none."""
    def values(key):
        return list(dict.fromkeys(str(r[key]) for r in records if r.get(key) is not None))

    parts = []
    if names := values("device_name"):
        parts.append(f"Device: {', '.join(names)}")
    if dates := values("date"):
        parts.append(f"date {', '.join(dates)}")
    if commands := values("command"):
        parts.append("command: " + ", ".join(f"`{c}`" for c in commands))
    return ["; ".join(parts) + ".", ""] if parts else []


def _md_code(text: str) -> str:
    """``text`` as inline code in a Markdown table cell (its pipes escaped, backticks dropped); '' for ''."""
    return f"`{text.replace('`', '').replace('|', chr(92) + '|')}`" if text else ""


def _switch_lines(records: list[dict]) -> list[str]:
    """The bench's table of specdec plain under each ``experiment.plain_switches`` setting against
    the default, per sweep job, target and batch (the first record of each: one plain run serves
    every point of a batch); none without switches."""
    from .timing import SPREAD

    def cell(v, fmt=".3f"):
        return "-" if v is None else format(v, fmt)

    lines, seen = [], set()
    for r in records:
        key = (r.get("job"), r.get("model"), r.get("batch"))
        if key in seen or not r.get("plain_switches"):
            continue
        if not lines:
            lines = ["", "## specdec plain under environment switches, round by round with the default", "",
                     f"Decode ms per step, {SPREAD}; vs default: the switch's step / the default's, round by round "
                     "(within noise: its range includes 1; - for one round); default env: the default run's values "
                     "of the names set.", "",
                     "| model | batch | switch | plain ms/step | default ms/step | vs default | within noise | "
                     "same output | default env |",
                     "|---|---|---|---|---|---|---|---|---|"]
        seen.add(key)
        name = key[1] if key[0] is None else f"{key[1]} (job {key[0]})"
        for label, f in r["plain_switches"].items():
            noise = {True: "yes", False: "no"}.get(f.get("within_noise"), "-")
            env = _md_code(", ".join(f"{k}={v}" for k, v in (f.get("default_env") or {}).items()))
            lines.append(
                f"| {name} | {key[2]} | {_md_code(label)} | {cell(f['decode_ms_per_step'])} "
                f"({cell(f['decode_ms_per_step_min'])}-{cell(f['decode_ms_per_step_max'])}) | "
                f"{cell(r.get('plain_decode_ms_per_step'))} ({cell(r.get('plain_decode_ms_per_step_min'))}-"
                f"{cell(r.get('plain_decode_ms_per_step_max'))}) | {cell(f['vs_default'])} "
                f"({cell(f['vs_default_min'])}-{cell(f['vs_default_max'])}) | {noise} | "
                f"{'yes' if f['same_output'] else 'no'} | {env or '-'} |")
    return lines


def _divergence_lines(records: list[dict]) -> list[str]:
    """Per bench record with diverged rows: each row's first divergence and the plain run's top-2
    logit margin there."""
    lines = []
    for r in records:
        if not r.get("diverged_rows"):
            continue
        acc = f", acceptance {r['acceptance']}" if r.get("acceptance") is not None else ""
        events = "; ".join(f"row {row}: position {pos}, margin {_fmt(m, '{:.4f}')}" for row, pos, m in
                           zip(r["diverged_row_ids"], r["first_divergence"], r["divergence_margins"]))
        lines.append(f"- {r['model']}, {r['drafter']}{acc}, {r['rollback']}, batch {r['batch']}: {events}")
    if not lines:
        return []
    return ["", "First divergences from specdec plain (row: new-token position, plain decoding's top-2 logit "
            "margin there, from a teacher-forced forward over the plain text):", ""] + lines


def write_report(records: list[dict], out_dir: Path, title: str, console: bool = True) -> str:
    """``summary.md`` (a table per experiment with its column legend, the rollback
    recommendation) and the plots in ``out_dir``, from ``records``; prints the key columns and
    the legend when ``console`` (at most :data:`TERMINAL_WIDTH` wide). Returns the Markdown."""
    out_dir = Path(out_dir)
    by_exp: dict = defaultdict(list)
    for r in records:
        by_exp[_experiment(r)].append(r)
    lines = [f"# {title}", ""] + provenance_lines(records)
    if not records:
        lines.append("(no records)")
    several = len(by_exp) > 1
    for exp, recs in by_exp.items():
        base, columns, count_title = SECTIONS.get(exp, SECTIONS["acceptance"])
        keys = _keys_for(recs, base)
        rows = summarize(recs, keys, columns)
        shown = _present(rows, columns)
        if several:
            lines += [f"## {exp}", ""]
        lines += _table_lines(rows, keys, shown, count_title)
        legend = legend_lines(shown)
        cpu = (exp in ("acceptance", "rollback", "bench", "adaptive")
               and any(_key_value(r, "device") == "cpu" for r in recs)
               and any(c.spread for c in shown))
        lines += ["", "Columns:", ""] + legend + (["", cpu_note(shown)] if cpu else [])
        on_terminal = (print_table(f"{title} ({exp})" if several else title, rows, keys, columns, count_title)
                       if console else [])
        prefix = f"{exp}_" if several else ""
        subtitle = plot_subtitle(recs)
        if exp == "acceptance":
            accept_histogram_plot(recs, out_dir / f"{prefix}accept_hist.png")
        elif exp == "rollback":
            lines += _rollback_notes(recs)
            lines += _recommendation_lines(recs)
            rollback_time_plot(rows, out_dir / f"{prefix}rollback_time_vs_batch.png", subtitle)
            speedup_plot(rows, out_dir / f"{prefix}speedup_vs_batch.png", subtitle)
        elif exp == "bench":
            lines += _divergence_lines(recs)
            lines += _switch_lines(recs)
            decode_speedup_plot(rows, out_dir / f"{prefix}speedup_vs_batch.png", subtitle)
        elif exp == "adaptive":
            lines += _divergence_lines(recs)
            decode_speedup_plot(rows, out_dir / f"{prefix}speedup_vs_batch.png", subtitle)
            k_over_time_plot(recs, out_dir / f"{prefix}k_over_time.png")
        elif exp == "serve":
            serve_plot(recs, out_dir / f"{prefix}serve_latency.png")
        if console:
            import textwrap

            terminal = on_terminal
            print("Columns (summary.md has all of them, each with its min-max where it has one):")
            for ln in legend_lines(terminal, markdown=False):
                print(textwrap.fill(ln, TERMINAL_WIDTH, subsequent_indent="    "))
            if exp == "rollback":
                for ln in _rollback_notes(recs)[1:]:
                    print(textwrap.fill(ln.removeprefix("- "), TERMINAL_WIDTH, subsequent_indent="    "))
                _print_recommendation(recs)
            if cpu:
                print(textwrap.fill(cpu_note(terminal), TERMINAL_WIDTH))
        lines.append("")
    text = "\n".join(lines).rstrip() + "\n"
    (out_dir / "summary.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    """``python -m specdec.experiments.report RUN_DIR [TITLE]``: ``summary.md`` and the plots of
    ``RUN_DIR`` from its ``results.jsonl``.

    Raises: SystemExit with a one-line message when ``RUN_DIR/results.jsonl`` is missing."""
    import json
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        raise SystemExit("usage: python -m specdec.experiments.report RUN_DIR [TITLE]  (rewrites RUN_DIR/summary.md "
                         "and the plots from RUN_DIR/results.jsonl)")
    run_dir = Path(args[0])
    path = run_dir / "results.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path}: no such file (a run folder of specdec-run holds results.jsonl)")
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    write_report(records, run_dir, args[1] if len(args) > 1 else f"Results of {run_dir}")


if __name__ == "__main__":
    main()
