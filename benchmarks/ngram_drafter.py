"""Time of one n-gram (prompt lookup) proposal: the batched device search
(``NGramDrafter.propose_batched``) against the per-row host loop
(``specdec.drafters.ngram.propose_ngram_reference``), side by side in one run.
``NGramDrafter.propose`` uses the loop up to ``HOST_SEARCH_MAX_BATCH`` rows and the batched
search above, from these figures.

For each batch B and text width W: random texts over a 64-token vocabulary (repeats are
common, so most rows find a match), ragged lengths in [W/2, W], K = 4, n-grams 1..3. Time =
median of ``--repeat`` calls after 3 warm-ups, with ``torch.cuda.synchronize()`` around each
call on CUDA (the loop's ``.cpu()`` copy and per-row writes are what it costs there). Both give
the same proposals (checked every point; ``tests/test_property.py`` checks it on random cases).

    python benchmarks/ngram_drafter.py --out ngram.md                 # CUDA if available, else CPU
    python benchmarks/ngram_drafter.py --device cpu --batches 1,16 --widths 256,1024
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from specdec.drafters import NGramDrafter  # noqa: E402
from specdec.drafters.ngram import propose_ngram_reference  # noqa: E402


def median_ms(fn, device, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--widths", default="256,1024,4096")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None, help="Markdown file for the table")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (1 thread)"
    lines = [f"# n-gram proposal time: batched search vs per-row loop ({name}, {datetime.date.today()})", "",
             (f"`python benchmarks/ngram_drafter.py {' '.join(argv if argv is not None else sys.argv[1:])}`; "
              f"K = {args.K}, n-grams 1..3, vocabulary 64, lengths in [W/2, W]; median of {args.repeat} calls."), "",
             "| batch | width | per-row loop ms | batched ms | loop / batched | rows with drafts |",
             "|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    drafter = NGramDrafter(1, 3)
    g = torch.Generator().manual_seed(0)
    for B in [int(x) for x in args.batches.split(",")]:
        for W in [int(x) for x in args.widths.split(",")]:
            ids = torch.randint(0, 64, (B, W), generator=g).to(device)
            lengths = torch.randint(W // 2, W + 1, (B,), generator=g).to(device)
            new = drafter.propose_batched(ids, lengths, args.K)
            ref = propose_ngram_reference(ids, lengths, args.K, 1, 3)
            if not (torch.equal(new[0], ref[0]) and torch.equal(new[1], ref[1])):
                raise SystemExit(f"proposals differ at B={B} W={W}")
            loop = median_ms(lambda ids=ids, lengths=lengths: propose_ngram_reference(ids, lengths, args.K, 1, 3), device, args.repeat)
            batched = median_ms(lambda ids=ids, lengths=lengths: drafter.propose_batched(ids, lengths, args.K), device, args.repeat)
            row = (f"| {B} | {W} | {loop:.3f} | {batched:.3f} | {loop / batched:.1f}x | "
                   f"{int((new[1] > 0).sum())}/{B} |")
            lines.append(row)
            print(row, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
