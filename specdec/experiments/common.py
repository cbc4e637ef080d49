"""Pieces every experiment shares: the record's common fields (with where and how it was
measured), drafters, CPU threads, progress bars, outputs."""

from __future__ import annotations

import datetime
import functools
import json
import platform
from pathlib import Path

from omegaconf import OmegaConf

from ..settings import context_length

__all__ = ["common_fields", "provenance", "run_command", "make_drafter", "mtp_draft_vocab", "apply_cpu_threads",
           "progress_bar", "write_outputs", "write_jsonl", "append_jsonl", "RunRecords"]


def run_command() -> str | None:
    """The ``specdec-run`` command line of the running Hydra job (its overrides), or None outside
    one (e.g. a config composed in a test)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        overrides = HydraConfig.get().overrides.task
    except (ImportError, ValueError):  # ValueError: no Hydra job is running
        return None
    return " ".join(["specdec-run", *overrides])


def provenance(device) -> dict:
    """``device_name`` (the GPU's name, or the CPU's), ``date`` (ISO) and ``command``
    (:func:`run_command`): what every report states next to its figures."""
    import torch

    dev = torch.device(device)
    name = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
            else f"CPU ({platform.processor() or platform.machine()})")
    return {"device_name": name, "date": datetime.date.today().isoformat(), "command": run_command()}


def common_fields(cfg, experiment: str, spec, device, dtype) -> dict:
    """Fields every record starts with: the experiment, model, device (:func:`provenance`
    included), dtype, seed and the resolved config (``config``)."""
    return {
        "experiment": experiment,
        "model": str(spec.name),
        "max_new_tokens": int(cfg.max_new_tokens),
        "prompt_set": str(cfg.prompts.set),
        "device": str(device),
        **provenance(device),
        "dtype": str(dtype).replace("torch.", ""),
        "seed": int(cfg.seed),
        "config": OmegaConf.to_container(cfg, resolve=True),
    }


def check_context(name: str, model, prompt_tokens: int, max_new_tokens: int, key: str = "max_new_tokens") -> None:
    """Raise ValueError when the longest prompt (``prompt_tokens``) and ``max_new_tokens`` (the
    setting ``key``) pass the context of target ``name`` (``config.max_position_embeddings``; no
    bound without it), as ``generate_batch`` refuses such a request: before any generation,
    naming the most it may be."""
    limit = context_length(model)
    if limit is not None and prompt_tokens + max_new_tokens > limit:
        raise ValueError(f"{key}={max_new_tokens}: with the longest prompt ({prompt_tokens} tokens) it "
                         f"passes {name}'s context (max_position_embeddings={limit}); at most "
                         f"{max(limit - prompt_tokens, 0)} new tokens")


def make_drafter(cfg, name: str, draft_model=None, *, reference=None, attention_mask=None,
                 acceptance: float | list[float] | None = None, target=None, tokenizer=None,
                 random_mtp: bool = False):
    """A fresh drafter for ``name`` from ``cfg.drafter``: ``ngram``, ``draft_model`` (needs
    ``draft_model``), ``oracle`` (an :class:`specdec.drafters.OracleDrafter` proposing
    ``reference [B, L + G]``, the plain output of the same batch with its prompts'
    ``attention_mask``, at per-token ``acceptance``, or a schedule of it per new-token position;
    seeded with ``cfg.seed``) or ``mtp`` (the MTP
    layers of ``target``'s checkpoint, :meth:`~specdec.drafters.MTPDrafter.for_model`, or with
    ``random_mtp`` random ones, :meth:`~specdec.drafters.MTPDrafter.random` seeded with
    ``cfg.seed``; with ``drafter.mtp_draft_vocab=N`` over the N most frequent ids of the zoo's
    training corpus as ``tokenizer`` encodes it, :func:`mtp_draft_vocab`; with
    ``drafter.mtp_compile=true`` its captured proposals compiled whole, ``compile_proposal``).

    Raises: ValueError for an unknown name or a missing draft model / reference / target."""
    from specdec.drafters import DraftModelDrafter, MTPDrafter, NGramDrafter, OracleDrafter

    if str(name) == "ngram":
        return NGramDrafter(min_ngram=int(cfg.drafter.ngram.min_ngram), max_ngram=int(cfg.drafter.ngram.max_ngram))
    if str(name) == "draft_model":
        if draft_model is None:
            raise ValueError("drafter draft_model needs a target with a draft model (model.targets[*].draft)")
        return DraftModelDrafter(draft_model, rollback=str(cfg.drafter.draft_rollback))
    if str(name) == "oracle":
        if reference is None or acceptance is None:
            raise ValueError("drafter oracle proposes the plain output of the same batch: it runs in experiment=bench, "
                             "long_run and checks")
        rate = [float(a) for a in acceptance] if isinstance(acceptance, (list, tuple)) else float(acceptance)
        return OracleDrafter(reference, attention_mask, acceptance=rate, seed=int(cfg.seed))
    if str(name) == "mtp":
        if target is None:
            raise ValueError("drafter mtp runs the target's own MTP layers: it needs the target model")
        vocab = mtp_draft_vocab(cfg, tokenizer, target.config.get_text_config().vocab_size)
        compiled = bool(cfg.drafter.get("mtp_compile", False))
        if random_mtp:
            return MTPDrafter.random(target, seed=int(cfg.seed), draft_vocab=vocab, compile_proposal=compiled)
        return MTPDrafter.for_model(target, draft_vocab=vocab, compile_proposal=compiled)
    raise ValueError(f"unknown drafter {name!r}; available: ngram, draft_model, oracle, mtp")


def mtp_draft_vocab(cfg, tokenizer, vocab_size: int):
    """``drafter.mtp_draft_vocab=N``: the N most frequent token ids (LongTensor ``[N]``,
    :func:`specdec.drafters.frequent_token_ids`) of the zoo's training corpus, the stdlib files
    outside the held-out split that every zoo model trained on, as ``tokenizer`` encodes it
    (:func:`.train_zoo.corpus_token_counts`; counted once per tokenizer and process, ~10 s); ids
    the tokenizer never produces rank last, lowest first. None when the key is null.

    Raises: ValueError without a tokenizer or for N outside ``[1, vocab_size]``."""
    n = cfg.drafter.get("mtp_draft_vocab")
    if n is None:
        return None
    if not 1 <= int(n) <= vocab_size:
        raise ValueError(f"drafter.mtp_draft_vocab={n}: the draft vocabulary must hold 1 to {vocab_size} ids (the "
                         "target's vocabulary)")
    if tokenizer is None:
        raise ValueError("drafter.mtp_draft_vocab counts tokens of the training corpus: it needs the target's tokenizer")
    from specdec.drafters import frequent_token_ids

    return frequent_token_ids(int(n), counts=_corpus_counts(tokenizer, int(vocab_size)))


@functools.lru_cache(maxsize=4)
def _corpus_counts(tokenizer, vocab_size: int):
    from .train_zoo import corpus_token_counts

    return corpus_token_counts(tokenizer, vocab_size)


def apply_cpu_threads(cfg, model, device, show: bool = True):
    """Torch's CPU thread count for ``model`` (:func:`specdec.threads.configure_cpu_threads`: the
    ``cpu_threads`` key when set, else chosen, never overriding ``OMP_NUM_THREADS`` or a count the
    user set); prints what it set as one line when ``show``. Returns the ThreadChoice (None,
    changing nothing, without a model and without ``cpu_threads``)."""
    from ..threads import configure_cpu_threads

    threads = cfg.get("cpu_threads")
    if model is None and threads is None:  # nothing to size the choice by: torch's default stays
        return None
    params = None if model is None else sum(p.numel() for p in model.parameters())
    choice = configure_cpu_threads(model, threads=None if threads is None else int(threads), device=device,
                                   num_parameters=params)
    if show and choice.source != "not on CPU":
        print(f"specdec-run: {choice.describe()}", flush=True)
        if params is not None and params >= CPU_SLOW_PARAMETERS:
            print(f"specdec-run: a {params / 1e9:.1f}B-parameter model on a CPU takes minutes a call; the bench "
                  "shapes are for a GPU, and their tiny configs (model=qwen35-tiny-shape, model=nemotronh-tiny-shape) "
                  "run here in seconds", flush=True)
    return choice


#: parameters from which a model run on a CPU gets a note that it will be slow (the bench shapes: ~4B)
CPU_SLOW_PARAMETERS = 1_000_000_000


def progress_bar(cfg, total: int, desc: str, enabled: bool = True):
    """A tqdm bar over ``total`` units (None when ``progress=false``)."""
    if not (cfg.progress and enabled):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="run", dynamic_ncols=True)


def write_jsonl(records: list[dict], path: Path) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def append_jsonl(record: dict, path: Path) -> None:
    """Append one record to ``path`` (JSON lines) as soon as it is measured: a run cut short keeps
    what it finished (``python -m specdec.experiments.report RUN_DIR`` summarises it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def write_outputs(records: list[dict], out_dir: Path, title: str, console: bool = True) -> str:
    """``results.jsonl``, ``summary.md`` and the plots into ``out_dir``; returns the summary."""
    from .report import write_report

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(records, out_dir / "results.jsonl")
    return write_report(records, out_dir, title, console=console)


class RunRecords:
    """The records of a run as it measures: each one appended to ``<out_dir>/results.jsonl`` at
    once (:func:`append_jsonl`: a run cut short keeps what it finished), then counted on the
    progress bar ``bar`` (set it once the run knows its size), or printed as one line without one.
    ``records`` holds them in order."""

    def __init__(self, out_dir: Path, bar=None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "results.jsonl"
        self.path.write_text("")
        self.records: list[dict] = []
        self.bar = bar

    def add(self, record: dict, line: str | None = None) -> None:
        """Keep ``record``; advance the bar, or print ``line`` when there is none."""
        self.records.append(record)
        append_jsonl(record, self.path)
        if self.bar:
            self.bar.update(1)
        elif line:
            print(line, flush=True)

    def close(self) -> None:
        """Close the progress bar (if any)."""
        if self.bar:
            self.bar.close()

