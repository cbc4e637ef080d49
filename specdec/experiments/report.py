"""Reports: per-configuration means from records, a Markdown summary, a terminal table, plots."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

__all__ = ["summarize", "write_summary", "print_table", "accept_histogram_plot", "COLUMNS"]

#: (record key, column title, format)
COLUMNS = (
    ("mean_accepted_tokens", "mean accepted tokens", "{:.2f}"),
    ("acceptance_rate", "acceptance rate", "{:.3f}"),
    ("tokens_per_s", "tokens/s", "{:.1f}"),
    ("plain_tokens_per_s", "plain tokens/s", "{:.1f}"),
    ("speedup", "speedup vs plain", "{:.2f}x"),
    ("exact", "exact", None),
)


def summarize(records: list[dict], keys=("model", "drafter", "rollback")) -> list[dict]:
    """One row per distinct ``keys``: mean of each numeric column over its records (prompts);
    ``exact`` is "yes" only when every record was exact, else "k/n"."""
    groups: dict = defaultdict(list)
    for r in records:
        groups[tuple(r[k] for k in keys)].append(r)
    rows = []
    for key, rs in groups.items():
        row = dict(zip(keys, key))
        row["prompts"] = len(rs)
        for col, _, _ in COLUMNS:
            if col == "exact":
                n = sum(bool(r["exact"]) for r in rs)
                row[col] = "yes" if n == len(rs) else f"{n}/{len(rs)}"
            else:
                row[col] = sum(float(r[col]) for r in rs) / len(rs)
        hist = [0] * max(len(r["accept_histogram"]) for r in rs)
        for r in rs:
            for i, v in enumerate(r["accept_histogram"]):
                hist[i] += v
        row["accept_histogram"] = hist
        rows.append(row)
    return rows


def _cells(row, keys):
    cells = [str(row[k]) for k in keys] + [str(row["prompts"])]
    for col, _, fmt in COLUMNS:
        cells.append(row[col] if fmt is None else fmt.format(row[col]))
    return cells


def _keys(rows):
    return [k for k in ("model", "drafter", "rollback", "num_speculative_tokens", "batch") if rows and k in rows[0]]


def write_summary(path: Path, title: str, rows: list[dict]) -> None:
    keys = _keys(rows)
    head = keys + ["prompts"] + [t for _, t, _ in COLUMNS]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        lines.append("| " + " | ".join(_cells(row, keys)) + " |")
    Path(path).write_text("\n".join(lines) + "\n")


def print_table(title: str, rows: list[dict]) -> None:
    keys = _keys(rows)
    try:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title)
        for h in keys + ["prompts"] + [t for _, t, _ in COLUMNS]:
            table.add_column(h, justify="left" if h in keys else "right")
        for row in rows:
            table.add_row(*_cells(row, keys))
        import sys

        Console(width=None if sys.stdout.isatty() else 160).print(table)
    except ImportError:  # pragma: no cover
        print(title)
        for row in rows:
            print(" | ".join(_cells(row, keys)))


def accept_histogram_plot(records: list[dict], path: Path) -> None:
    """Accepted-length histogram per drafter (share of verify steps that accepted n drafts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = defaultdict(list)
    for r in records:
        per[(r["model"], r["drafter"])].append(r["accept_histogram"])
    if not per:
        return
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
