"""Reports: per-configuration means from records, the Markdown summary, a terminal table, plots.

One function, :func:`write_report`, turns records (any mix of experiments: a single run, or
every job of a ``--multirun`` sweep) into ``summary.md`` and the PNG plots; the numbers in the
summary are the means of the records' fields over each configuration's records (prompts,
repeats or jobs), so they can always be recomputed from ``results.jsonl``.

Plots: ``accept_hist.png`` (acceptance: accepted-length histogram per drafter),
``rollback_time_vs_batch.png`` (rollback: commit + fold and whole SSM time per step, per
strategy), ``speedup_vs_batch.png`` (rollback and bench: speedup per strategy).
"""

from __future__ import annotations

import sys
from collections import defaultdict
from pathlib import Path

__all__ = ["summarize", "recommend", "write_report", "write_summary", "print_table", "accept_histogram_plot",
           "COLUMNS", "SECTIONS"]

#: (record key, column title, format; None = a yes/no column)
COLUMNS = (
    ("mean_accepted_tokens", "mean accepted tokens", "{:.2f}"),
    ("acceptance_rate", "acceptance rate", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("plain_tokens_per_s", "plain tokens/s", "{:.1f}"),
    ("speedup", "speedup vs plain", "{:.2f}x"),
    ("exact", "exact", None),
    ("near_tie", "divergences at near-ties", None),
)

ROLLBACK_COLUMNS = (
    ("e2e_verify_ms", "verify ms/step", "{:.2f}"),
    ("e2e_commit_ms", "commit ms/step", "{:.3f}"),
    ("kernel_verify_us", "layer verify us", "{:.1f}"),
    ("kernel_commit_us", "layer commit us", "{:.1f}"),
    ("kernel_fold_us", "layer fold us", "{:.1f}"),
    ("ssm_ms_per_step", "SSM ms/step", "{:.3f}"),
    ("bytes_per_step_MB", "MB moved/step", "{:.3f}"),
    ("extra_MiB_per_seq", "extra MiB/seq", "{:.3f}"),
    ("max_batch", "max batch", "{:.0f}"),
    ("speedup", "speedup vs plain", "{:.2f}x"),
    ("exact", "exact output", None),
    ("state_exact", "exact state", None),
    ("kernel_state_exact", "exact layer state", None),
)

BENCH_COLUMNS = (
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("plain_tokens_per_s", "plain tokens/s", "{:.1f}"),
    ("speedup", "speedup vs plain", "{:.2f}x"),
    ("ms_per_step", "ms/step", "{:.2f}"),
    ("mean_accepted_tokens", "mean accepted tokens", "{:.2f}"),
    ("exact", "exact", None),
)

KERNEL_COLUMNS = (
    ("launches", "launches", "{:.0f}"),
    ("us_per_step", "us/step", "{:.1f}"),
    ("vs_snapshot", "vs snapshot", "{:.2f}"),
    ("vs_baseline", "vs baseline", "{:.2f}"),
    ("kernel_MB", "kernel MB", "{:.1f}"),
    ("design_MB", "design MB", "{:.1f}"),
    ("GBps", "GB/s", "{:.0f}"),
    ("pct_copy_bw", "% copy BW", "{:.0f}%"),
    ("x_floor", "x floor", "{:.2f}"),
    ("extra_MiB_per_seq", "extra MiB/seq", "{:.1f}"),
    ("max_batch", "max batch", "{:.0f}"),
    ("exact", "exact", None),
)

#: means the plots and the recommendation use, not shown in the table
HIDDEN_COLUMNS = (
    ("rollback_ms_per_step", "rollback ms/step", "{:.3f}"),
    ("e2e_step_ms", "verify + commit ms/step", "{:.3f}"),
)

#: experiment -> (group keys, columns, count column title)
SECTIONS = {
    "acceptance": (("model", "drafter", "rollback", "num_speculative_tokens"), COLUMNS, "prompts"),
    "rollback": (("model", "drafter", "rollback", "batch", "num_speculative_tokens"), ROLLBACK_COLUMNS, "runs"),
    "bench": (("model", "drafter", "rollback", "batch", "num_speculative_tokens"), BENCH_COLUMNS, "runs"),
    "kernels": (("op", "batch", "num_speculative_tokens", "rollback", "launch"), KERNEL_COLUMNS, "runs"),
}
#: column titles of the group keys
KEY_TITLES = {"num_speculative_tokens": "K"}
#: config fields that become group keys when they differ between records (multirun sweeps)
SWEPT = ("max_new_tokens", "prompt_set", "dtype", "device", "seed")


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


def summarize(records: list[dict], keys=None, columns=None) -> list[dict]:
    """One row per distinct ``keys`` (default: the experiment's), in first-seen order.

    Numeric columns: the mean over the group's records that have a value (None when none
    has). Yes/no columns: "yes" when all are true, else "k/n" (None when none has a value).
    ``prompts``: the group's record count. ``accept_histogram``: summed when present.
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
        for col, _, fmt in columns:
            vals = [r[col] for r in rs if r.get(col) is not None]
            if not vals:
                row[col] = None
            elif fmt is None:
                n = sum(bool(v) for v in vals)
                row[col] = "yes" if n == len(vals) else f"{n}/{len(vals)}"
            else:
                row[col] = sum(float(v) for v in vals) / len(vals)
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
    return [c for c in columns if any(row.get(c[0]) is not None for row in rows)]


def _fmt(value, fmt) -> str:
    if value is None:
        return "-"
    return str(value) if fmt is None else fmt.format(value)


def _cells(row, keys, columns):
    return [str(row[k]) for k in keys] + [str(row["prompts"])] + [_fmt(row[c], f) for c, _, f in columns]


def _table_lines(rows, keys, columns, count_title) -> list[str]:
    head = [KEY_TITLES.get(k, k) for k in keys] + [count_title] + [t for _, t, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cells(row, keys, columns)) + " |" for row in rows]
    return lines


def write_summary(path: Path, title: str, rows: list[dict], keys=None, columns=COLUMNS, count_title="prompts") -> None:
    """A Markdown file: ``# title`` and the table of ``rows`` (from :func:`summarize`)."""
    keys = keys or [k for k in SECTIONS["acceptance"][0] if rows and k in rows[0]]
    columns = _present(rows, columns)
    Path(path).write_text("\n".join([f"# {title}", ""] + _table_lines(rows, keys, columns, count_title)) + "\n")


def print_table(title: str, rows: list[dict], keys=None, columns=COLUMNS, count_title="prompts") -> None:
    """The table on the terminal (rich; 160 columns wide when stdout is not a terminal)."""
    keys = keys or [k for k in SECTIONS["acceptance"][0] if rows and k in rows[0]]
    columns = _present(rows, columns)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # pragma: no cover - rich is a dependency
        print(title)
        for row in rows:
            print(" | ".join(_cells(row, keys, columns)))
        return
    table = Table(title=title)
    for i, h in enumerate([KEY_TITLES.get(k, k) for k in keys] + [count_title] + [t for _, t, _ in columns]):
        table.add_column(h, justify="left" if i < len(keys) else "right")
    for row in rows:
        table.add_row(*_cells(row, keys, columns))
    Console(width=None if sys.stdout.isatty() else 200).print(table)


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
    fastest's) and ``snapshot_x`` (snapshot's time / the fastest's).
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
        out.append({**dict(zip(keys, key)), "fastest": best["rollback"], "ms_per_step": best[col],
                    "runner_up": ok[1]["rollback"] if len(ok) > 1 else None,
                    "runner_up_x": ok[1][col] / best[col] if len(ok) > 1 and best[col] > 0 else None,
                    "snapshot_x": snap[col] / best[col] if snap is not None and best[col] > 0 else None})
    return out, text


def _recommendation_lines(records) -> list[str]:
    rows, text = recommend(records)
    if not rows:
        return []
    keys = [k for k in rows[0] if k not in ("fastest", "ms_per_step", "runner_up", "runner_up_x", "snapshot_x")]
    head = [KEY_TITLES.get(k, k) for k in keys] + ["fastest", "ms/step", "runner-up", "runner-up / fastest",
                                                    "snapshot / fastest"]
    lines = ["", "## Recommendation", "", f"Fastest exact strategy per grid point, by {text}.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r[k]) for k in keys] + [r["fastest"], f"{r['ms_per_step']:.3f}", r["runner_up"] or "-",
                                             _fmt(r["runner_up_x"], "{:.2f}x"), _fmt(r["snapshot_x"], "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _rollback_notes(records) -> list[str]:
    """What the rollback table's columns are, and the SSM shape / S / I / budget behind them."""
    lines = ["", "Columns: `verify` / `commit ms/step`: per verify step of the real `generate()` runs "
             "(specdec.Stats verify_s / rollback_s; commit includes the replay fold); `layer verify / commit / "
             "fold us`: one SSM layer, the strategy on synthetic inputs at the model's SSM shape; `SSM ms/step`: "
             "their sum over all SSM layers; `MB moved/step`: DESIGN.md's cost model x layers x batch; "
             "`extra MiB/seq`: the strategy's memory beyond the live state, all SSM layers; `max batch`: the largest "
             "batch whose SSM state (live + extra) fits the memory budget; `exact output`: == HF greedy; "
             "`exact state`: committed SSM state == HF's (rel. err < 1e-5 fp32); `exact layer state`: kernel-level "
             "state == the fp32 reference.", ""]
    seen = set()
    for r in records:
        if r.get("ssm_shape") is None:
            continue
        key = (r["model"], r["ssm_shape"])
        if key in seen:
            continue
        seen.add(key)
        budget = (r.get("config") or {}).get("experiment", {}).get("memory_budget_gib")
        I_vals = sorted({r2.get("input_bytes_per_token") for r2 in records
                         if r2["model"] == r["model"] and r2.get("input_bytes_per_token")})
        lines.append(f"- {r['model']}: SSM layers {r['ssm_shape']}; S = {r['state_bytes'] / 1024:.1f} KiB per layer "
                     f"and sequence (fp32), I = {', '.join(str(i) for i in I_vals)} B per token"
                     + (f"; memory budget {budget} GiB" if budget is not None else ""))
    return lines


# ------------------------------------------------------------------------------- plots


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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
        ax.bar([j + i * width for j in range(n)], [t / s for t in tot], width, label=f"{model} / {drafter}")
    ax.set_xlabel("drafts accepted in a verify step")
    ax.set_ylabel("share of steps")
    ax.set_title("Accepted length per drafter")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_STYLES = ("-o", "--s", ":^", "-.v", "-D", "--x")


def _lines_vs_batch(ax, rows, col, ylabel, title, scale=1.0):
    strategies = list(dict.fromkeys(r["rollback"] for r in rows))
    Ks = sorted({r["num_speculative_tokens"] for r in rows})
    colors = {s: f"C{i}" for i, s in enumerate(strategies)}
    drawn = False
    for s in strategies:
        for i, K in enumerate(Ks):
            pts = sorted((r["batch"], r[col] * scale) for r in rows
                         if r["rollback"] == s and r["num_speculative_tokens"] == K and r.get(col) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], _STYLES[i % len(_STYLES)], color=colors[s],
                        label=f"{s}, K={K}")
                drawn = True
    batches = sorted({r["batch"] for r in rows})
    if len(batches) > 1 and batches[0] > 0 and batches[-1] / batches[0] >= 8:
        ax.set_xscale("log", base=2)
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("batch")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if drawn:
        ax.legend(fontsize=7)
    return drawn


def rollback_time_plot(rows: list[dict], path: Path) -> None:
    """Rollback (commit + fold) and whole SSM time per step vs batch, a line per strategy and K."""
    kernel = any(r.get("rollback_ms_per_step") is not None for r in rows)
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    if kernel:
        _lines_vs_batch(axes[0], rows, "rollback_ms_per_step", "ms per step", "commit + fold, all SSM layers (kernel level)")
        _lines_vs_batch(axes[1], rows, "ssm_ms_per_step", "ms per step", "verify + commit + fold, all SSM layers")
    else:
        _lines_vs_batch(axes[0], rows, "e2e_commit_ms", "ms per step", "commit (+ fold), end to end")
        _lines_vs_batch(axes[1], rows, "e2e_step_ms", "ms per step", "verify + commit, end to end")
    fig.suptitle("Rollback time vs batch, per strategy")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_plot(rows: list[dict], path: Path) -> None:
    """Speedup over plain HF generate vs batch per strategy (kernel-level runs: vs snapshot)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    if any(r.get("speedup") is not None for r in rows):
        _lines_vs_batch(ax, rows, "speedup", "speedup (x)", "end-to-end speedup over plain HF generate()")
    else:  # kernel-level only: SSM time of snapshot / the strategy's, per (batch, K)
        snap = {(r["model"], r["batch"], r["num_speculative_tokens"]): r.get("ssm_ms_per_step") for r in rows
                if r["rollback"] == "snapshot"}
        rel = []
        for r in rows:
            s = snap.get((r["model"], r["batch"], r["num_speculative_tokens"]))
            if s and r.get("ssm_ms_per_step"):
                rel.append({**r, "vs_snapshot": s / r["ssm_ms_per_step"]})
        _lines_vs_batch(ax, rel, "vs_snapshot", "speedup (x)", "SSM time per step: snapshot / strategy (kernel level)")
    ax.axhline(1.0, color="grey", lw=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------- report


def write_report(records: list[dict], out_dir: Path, title: str, console: bool = True) -> str:
    """``summary.md`` (a table per experiment, the rollback recommendation) and the plots in
    ``out_dir``, from ``records``; prints the tables when ``console``. Returns the Markdown."""
    out_dir = Path(out_dir)
    by_exp: dict = defaultdict(list)
    for r in records:
        by_exp[_experiment(r)].append(r)
    lines = [f"# {title}", ""]
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
        if console:
            print_table(f"{title} ({exp})" if several else title, rows, keys, columns, count_title)
        prefix = f"{exp}_" if several else ""
        if exp == "acceptance":
            accept_histogram_plot(recs, out_dir / f"{prefix}accept_hist.png")
        elif exp == "rollback":
            lines += _rollback_notes(recs)
            rec_lines = _recommendation_lines(recs)
            lines += rec_lines
            if console and rec_lines:
                print("\n".join(rec_lines[1:]))
            rollback_time_plot(rows, out_dir / f"{prefix}rollback_time_vs_batch.png")
            speedup_plot(rows, out_dir / f"{prefix}speedup_vs_batch.png")
        elif exp == "bench":
            speedup_plot(rows, out_dir / f"{prefix}speedup_vs_batch.png")
        lines.append("")
    text = "\n".join(lines).rstrip() + "\n"
    (out_dir / "summary.md").write_text(text)
    return text
