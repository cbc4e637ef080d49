"""What the tests compare against and the inputs they share (not a test module).

* Reference decoding: :func:`hf_greedy` (plain autoregressive decoding through HF ``generate``),
  :func:`hf_states` (the SSM / conv state of HF's own per-token decode of a text;
  :class:`GrowingHFStates` for texts checked again as they grow), the standard
  per-family setting :func:`reference` with its drafters (:func:`make_drafter`), :func:`rel_err`,
  :func:`assert_same_token_distribution` (sampling: two-sample chi-square per position).
* Names: :data:`ALL_STRATEGIES` (every rollback strategy name ``wrap`` accepts) and
  :data:`STRATEGY_FACTORIES` (a fresh strategy per name, for the op-level tests).
* Op-level inputs: :func:`random_inputs`, :func:`slice_inputs`.
* Medusa heads for the tiny models: :func:`medusa_prompts`, :func:`fit_medusa_heads`,
  :func:`perturb_heads`; MTP layers: :func:`fit_mtp_layers`.
* :class:`StreamRecorder`: a streamer that records every ``put()`` and ``end()``.
* :class:`DeviceOps`: the aten ops a block issues that launch a kernel, and its Triton launches.
* :func:`run_python`: ``python <args>`` in a subprocess that imports this checkout's ``specdec``;
  :func:`built_for_hopper`: a script that builds Triton kernels for sm_90, in a subprocess.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import subprocess
import sys
from pathlib import Path

import torch
from scipy.stats import chi2_contingency
from tiny_models import get_model, ragged_prompts
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache

from specdec.adaptive import CostModel
from specdec.drafters import DraftModelDrafter, MedusaHeads, MTPDrafter
from specdec.models.common import cache_keyword
from specdec.experiments.train_medusa import collect_hidden_states, fit_heads, medusa_targets, target_predictions
from specdec.experiments.train_mtp import fit_mtp
from specdec.rollback import STRATEGIES, ReplayRollback, make_strategy

#: every rollback strategy name: ``specdec.rollback.STRATEGIES`` and deferred replay
ALL_STRATEGIES = (*STRATEGIES, "replay_deferred")

#: a fresh strategy per name: every one of :data:`ALL_STRATEGIES`, and deferred replay with a
#: history of 8 tokens (it holds steps of up to 4 tokens, then refuses with a clear error)
STRATEGY_FACTORIES = {
    **{name: functools.partial(make_strategy, name) for name in ALL_STRATEGIES},
    "replay_deferred_L8": lambda: ReplayRollback(deferred=True, history=8),
}

#: new tokens of the standard exactness setting (:func:`reference`)
MAX_NEW = 16


# ------------------------------------------------------------------------------ reference decoding


@contextlib.contextmanager
def hf_torch_rules(model):
    """Within it, ``model``'s modeling module calls transformers' torch functions where, at import,
    it bound a package's kernel in their place (``use_kernel_func_from_hub_with_fallback``: with
    flash-linear-attention installed, its chunked and recurrent GDN / KDA rules, for every device);
    nothing changes for a model whose parameters are all on CUDA. fla runs on CUDA tensors only,
    so HF's own forward of a model with a layer on the CPU needs this wherever fla is installed."""
    if all(p.device.type == "cuda" for p in model.parameters()):
        yield
        return
    module = sys.modules[type(model).__module__]
    bound = {name: inspect.unwrap(fn) for name, fn in vars(module).items()
             if inspect.isfunction(fn) and "implementation" in fn.__code__.co_freevars}
    saved = {name: getattr(module, name) for name in bound}
    try:
        for name, fn in bound.items():
            setattr(module, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def hf_greedy(model, ids, mask, max_new=MAX_NEW, eos=None):
    """HF greedy ``generate`` of ``ids [B, L]`` (left-padded, pad id 0): ``[B, L + max_new]``; a
    model with a layer on the CPU runs transformers' torch rules (:func:`hf_torch_rules`)."""
    kw = {"eos_token_id": eos} if eos is not None else {}
    with hf_torch_rules(model):
        return model.generate(ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False, pad_token_id=0,
                              **kw)


_REF: dict = {}


def reference(family):
    """The standard exactness setting of ``family``'s tiny target: ``(ids, mask, eos, output)``,
    three ragged prompts and HF greedy's output for :data:`MAX_NEW` new tokens, with ``eos``
    chosen so that row 1 stops early (at its 4th new token or before) and the others do not."""
    if family not in _REF:
        model = get_model(family)
        ids, mask = ragged_prompts()
        plain = hf_greedy(model, ids, mask)
        L = ids.shape[1]
        eos = int(plain[1, L + 3])  # row 1 stops at its 4th new token (or earlier)
        ref = hf_greedy(model, ids, mask, eos=eos)
        assert ref.shape[1] > L + 4, "EOS must not stop every row early"
        _REF[family] = (ids, mask, eos, ref)
    return _REF[family]


def make_drafter(kind, family):
    """The drafter ``kind`` for ``family``'s tiny target: ``"ngram"``, ``"perturbed"`` (a noisy
    copy of the target as draft model) or ``"small"`` (a smaller model of the family)."""
    if kind == "ngram":
        return "ngram"
    if kind == "perturbed":
        return DraftModelDrafter(get_model(family, "perturbed"))
    return DraftModelDrafter(get_model(family, "small"))


@torch.no_grad()
def hf_states(model, adapter, texts, prompt_lens):
    """Reference states of each row's committed tokens, through HF's own cache: its prefill of
    the prompt, then its one-token decode step for every further token (the path HF generate
    takes). Returns ``{layer: (ssm_state [B, *S], conv_state [B, C, W])}`` (fp32).

    (HF's chunked prefill is not used past the prompt: for Nemotron-H it clamps dt to
    time_step_min while HF's decode step does not, so the two disagree on tiny random models.)
    """
    per_layer = {idx: ([], []) for idx in adapter.ssm_layers()}
    for text, p in zip(texts, prompt_lens):
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([text])
        kw = {cache_keyword(adapter.body.forward): cache, "use_cache": True}
        adapter.body(input_ids=ids[:, :p], **kw)
        for t in range(p, len(text)):
            adapter.body(input_ids=ids[:, t : t + 1], **kw)
        for idx in per_layer:
            per_layer[idx][0].append(cache.layers[idx].recurrent_states[0].float())
            per_layer[idx][1].append(cache.layers[idx].conv_states[0].float())
    return {idx: (torch.cat(s), torch.cat(c)) for idx, (s, c) in per_layer.items()}


class GrowingHFStates:
    """:func:`hf_states` of texts that only grow from one call to the next (each row's committed
    tokens, checked step after step): each row keeps HF's cache and runs its one-token decode
    steps for the new tokens only -- the forwards :func:`hf_states` runs from the start each
    time, so the same states, without the repeated prefix. A row whose text does not extend its
    last one starts over. ``self(texts)`` returns what ``hf_states(model, adapter, texts,
    prompt_lens)`` returns."""

    def __init__(self, model, adapter, prompt_lens):
        self.model, self.adapter, self.prompt_lens = model, adapter, list(prompt_lens)
        self.rows: dict = {}  # row -> (cache, the tokens it holds)

    @torch.no_grad()
    def __call__(self, texts):
        per_layer = {idx: ([], []) for idx in self.adapter.ssm_layers()}
        key = cache_keyword(self.adapter.body.forward)
        for i, (text, p) in enumerate(zip(texts, self.prompt_lens)):
            cache, held = self.rows.get(i, (None, None))
            if cache is None or len(text) < len(held) or text[:len(held)] != held:
                cache, held = DynamicCache(config=self.model.config), text[:p]
                self.adapter.body(input_ids=torch.tensor([held]), **{key: cache, "use_cache": True})
            for t in range(len(held), len(text)):
                self.adapter.body(input_ids=torch.tensor([text[t : t + 1]]), **{key: cache, "use_cache": True})
            self.rows[i] = (cache, list(text))
            for idx in per_layer:
                per_layer[idx][0].append(cache.layers[idx].recurrent_states[0].float())
                per_layer[idx][1].append(cache.layers[idx].conv_states[0].float())
        return {idx: (torch.cat(s), torch.cat(c)) for idx, (s, c) in per_layer.items()}  # (copies)


def within_ulp(got: torch.Tensor, want: torch.Tensor, units: float = 1, moved: float | None = None) -> bool:
    """Whether ``got`` is within ``units`` units in the last place of ``want``'s dtype of ``want``
    (plus 1e-6 absolute), and, with ``moved``, differs in fewer than that fraction of its elements."""
    ulp = want.float().abs() * torch.finfo(want.dtype).eps * units
    close = bool(((got.float() - want.float()).abs() <= ulp + 1e-6).all())
    return close and (moved is None or float((got != want).float().mean()) < moved)


def rel_err(a, b):
    """``||a - b|| / ||b||`` (Frobenius norms, in float64)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def assert_same_token_distribution(expected, got, start, positions, vocab, min_p=1e-3):
    """Token ``start + j`` (j < ``positions``) of the rows of ``expected`` and of ``got`` (``[N, *]``
    samples each) has one distribution: a two-sample chi-square test over the vocabulary
    (``vocab`` tokens) gives a p-value above ``min_p`` at every position."""
    for j in range(positions):
        a = torch.bincount(expected[:, start + j], minlength=vocab)
        b = torch.bincount(got[:, start + j], minlength=vocab)
        table = torch.stack([a, b]).numpy()
        table = table[:, table.sum(0) > 0]
        p = float(chi2_contingency(table)[1]) if table.shape[1] > 1 else 1.0
        assert p > min_p, f"position {j}: HF {a.tolist()} vs specdec {b.tolist()} (p={p:.2e})"


# ------------------------------------------------------------------------------ op-level inputs


def random_inputs(op, T, g, batch=3):
    """Random inputs of ``T`` tokens for the op ``op`` (``"mamba2"``, ``"gdn"`` or ``"kda"``):
    ``(inputs {name: [batch, T, ...]}, params, state shape S)``, drawn from the generator ``g``."""
    B = batch
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "mamba2":
        H, P, N, G = 4, 8, 6, 2
        inputs = {"x": r(B, T, H, P), "dt": torch.nn.functional.softplus(r(B, T, H)), "B": r(B, T, G, N),
                  "C": r(B, T, G, N)}
        return inputs, {"A": -torch.rand(H, generator=g) - 0.1, "D": r(H)}, (H, P, N)
    H, K, V = 2, 8, 6
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1) * K**-0.5
    g_shape = (B, T, H, K) if op == "kda" else (B, T, H)
    inputs = {"q": q, "k": k, "v": r(B, T, H, V), "g": -torch.nn.functional.softplus(r(*g_shape)),
              "beta": torch.rand(B, T, H, generator=g)}
    return inputs, {}, (H, K, V)


def slice_inputs(inputs, a, b):
    """Tokens ``a .. b-1`` of every input."""
    return {k: v[:, a:b] for k, v in inputs.items()}


# ------------------------------------------------------------------------------ Medusa heads


def medusa_prompts():
    """The ragged, left-padded prompts the Medusa tests fit heads on and decode: ``(ids, mask)``."""
    return ragged_prompts(seed=5)


def fit_medusa_heads(model, ids, mask, num_heads=3, num_layers=1, steps=60) -> MedusaHeads:
    """Heads initialised from ``model``'s LM head and fitted (a fraction of a second) to its own
    greedy continuations (40 tokens) of the prompts ``ids``, so their drafts are often accepted."""
    seqs = torch.cat([model.generate(ids[i][mask[i].bool()][None], max_new_tokens=40, do_sample=False,
                                     pad_token_id=0)[:, -44:] for i in range(ids.shape[0])])
    hidden = collect_hidden_states(model, seqs, batch=16, progress=False)
    x, y = medusa_targets(hidden, target_predictions(model, hidden, seqs), num_heads)
    torch.manual_seed(0)
    heads = MedusaHeads.from_target(model, num_heads=num_heads, num_layers=num_layers, vocab_bias=True)
    fit_heads(heads, x, y, steps=steps, batch_positions=256, lr=1e-2, warmup_steps=5, log_every=1000,
              progress=False, log=lambda m: None)
    return heads


def perturb_heads(heads: MedusaHeads, scale: float = 1.5, seed: int = 1, relative: bool = True) -> MedusaHeads:
    """Add Gaussian noise to every head's LM head weight, in place: ``scale`` times the weight's
    std (``relative``) or ``scale`` itself. Fitted heads then often rank the right token below the
    top 1 but among the top few, so chain and tree acceptance are both partial and differ."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in heads.lm_heads:
            noise = torch.randn(lin.weight.shape, generator=g)
            lin.weight.add_(noise * lin.weight.std() * scale if relative else noise * scale)
    return heads


def fit_mtp_layers(model, layers, seqs, steps: int) -> None:
    """Fit the MTP ``layers`` of ``model`` in place (``steps`` steps, about a second) to the model's
    own predictions on the token windows ``seqs [W, L]``, so their drafts are often accepted there."""
    hidden = collect_hidden_states(model, seqs, progress=False)
    fit_mtp(MTPDrafter(model, layers), hidden, seqs, target_predictions(model, hidden, seqs), steps=steps,
            chain_steps=3, batch_windows=3, batch_positions=128, lr=1e-2, warmup_steps=5, log_every=1000,
            progress=False, log=lambda m: None)


# ------------------------------------------------------------------------------ streaming


#: aten ops that launch no kernel (views, allocation without a fill)
NO_KERNEL_OPS = {"empty", "empty_strided", "view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze",
                 "expand", "as_strided", "t", "transpose", "alias", "detach", "lift_fresh", "unbind"}


class DeviceOps(TorchDispatchMode):
    """Within the block: ``ops``, the aten ops that launch a kernel (by name), issued outside Triton
    launches (what the interpreter does inside one is its own copying), and ``triton``, the
    Triton launches by kernel name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
        self.triton = collections.Counter()
        self._inside = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL_OPS and not self._inside:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def _launches(self):
        import triton.runtime.jit as jit

        classes = [jit.JITFunction]
        with contextlib.suppress(ImportError):
            from triton.runtime.interpreter import InterpretedFunction

            classes.append(InterpretedFunction)
        saved = {cls: cls.run for cls in classes}

        def counted(run):
            def wrapper(fn, *args, **kwargs):
                if not kwargs.get("warmup"):  # (a warm-up compiles, it launches nothing)
                    self.triton[getattr(getattr(fn, "fn", fn), "__name__", "?")] += 1
                self._inside += 1
                try:
                    return run(fn, *args, **kwargs)
                finally:
                    self._inside -= 1
            return wrapper

        try:
            for cls, run in saved.items():
                cls.run = counted(run)
            yield
        finally:
            for cls, run in saved.items():
                cls.run = run

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(self._launches())
        try:
            return super().__enter__()
        except BaseException:
            self._stack.close()
            raise

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()

    @property
    def launches(self) -> int:
        """The kernel-launching aten ops (Triton launches are in ``triton``)."""
        return sum(self.ops.values())


class StreamRecorder:
    """A streamer that records every ``put()`` as ``("put", shape, dtype, values)`` and ``end()`` as
    ``("end",)``, in order."""

    def __init__(self):
        self.calls = []

    def put(self, value):
        self.calls.append(("put", tuple(value.shape), value.dtype, value.reshape(-1).tolist()))

    def end(self):
        self.calls.append(("end",))

    @property
    def puts(self):
        """The values of every ``put()``, flattened to token lists."""
        return [c[3] for c in self.calls if c[0] == "put"]

    @property
    def ended(self):
        return ("end",) in self.calls

    def new_tokens(self):
        """The tokens put after the prompt, one per ``put()`` (asserted)."""
        assert all(c[1] == (1,) for c in self.calls[1:-1])  # one token per put after the prompt
        return [c[3][0] for c in self.calls[1:-1]]


# ------------------------------------------------------------------------------ processes

#: the checkout these tests belong to
REPO = Path(__file__).resolve().parents[1]


def run_python(args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python <args>`` (e.g. ``["-m", "specdec", "experiment=..."]``) run from the checkout with it
    first on ``PYTHONPATH``; stdout and stderr captured as text."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


#: what :func:`built_for_hopper` defines before its script: ``hopper_ptx(fn, constexprs, types,
#: divisible_ints=False)``, the sm_90 PTX of the jit function ``fn`` with the ``constexprs`` given, each
#: other argument typed by ``types`` (name -> Triton type, default ``"i32"``) and assumed 16-aligned
#: (pointers; integers too with ``divisible_ints``)
_HOPPER_PRELUDE = """
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def hopper_ptx(fn, constexprs, types, divisible_ints=False):
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    aligned = [n for n in names if sig[n].startswith("*") or (divisible_ints and sig[n] == "i32")]
    src = ASTSource(fn, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
"""


def built_for_hopper(script: str):
    """Run ``script`` (Python that compiles Triton kernels ahead of time for sm_90, with
    ``hopper_ptx`` of :data:`_HOPPER_PRELUDE` defined, and prints one JSON line last) in a child
    process without ``TRITON_INTERPRET`` (this one may interpret); its parsed last line. Skips the
    test where the installed Triton cannot build for CUDA (no ptxas): such a machine cannot run
    the check, which is not a pass."""
    import json

    import pytest

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _HOPPER_PRELUDE + script], env=env, capture_output=True, text=True,
                         timeout=300)
    if run.returncode and "cannot find ptxas" in run.stderr.lower():  # (not an assembler error: that fails)
        pytest.skip(f"Triton cannot build for CUDA here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def record_prompt_forwards(sd) -> list[tuple[int, int]]:
    """Record the shape ``(rows, tokens)`` of every prompt forward ``sd``'s adapter runs from now
    on (prefills, their groups and chunks, admissions) in the returned list."""
    shapes = []
    real = sd.adapter._prompt_forward

    def recording(input_ids, *args, **kwargs):
        shapes.append(tuple(input_ids.shape))
        return real(input_ids, *args, **kwargs)

    sd.adapter._prompt_forward = recording
    return shapes


def counting_forwards(monkeypatch) -> list:
    """Count the decoders' verify forwards (eager and static), one entry per call."""
    from specdec.decoding import EagerDecoder, StaticDecoder

    seen = []
    for cls in (EagerDecoder, StaticDecoder):
        def counted(self, tokens, plain=False, _orig=cls.forward):
            seen.append(tokens.shape[1])
            return _orig(self, tokens, plain)
        monkeypatch.setattr(cls, "forward", counted)
    return seen


def compile_with_aot_eager(monkeypatch) -> None:
    """Make ``torch.compile`` use the ``aot_eager`` backend for the test (dynamo and
    functionalisation, no Inductor: a program's trace checked on a CPU)."""
    import functools

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))


class ScriptedCosts(CostModel):
    """Costs under which the best K follows ``order`` step after step (K = order[i] costs 1 s, every
    other K 100 s): forces the policy through every step width, 0 included, in a known order. A
    new step is a ``step_s`` call of K = 0 (each choice asks for every K in order), counted per
    strategy (``rollback="auto"`` compares them all once first); with ``strategy`` set, that
    strategy's steps cost half the others' (``rollback="auto"`` picks it)."""

    def __init__(self, order, strategy: str | None = None):
        self.order, self.strategy, self.calls = order, strategy, {}

    def step_s(self, key, drafter_key, K):
        if K == 0:
            self.calls[key.strategy] = self.calls.get(key.strategy, -1) + 1
        target = self.order[self.calls[key.strategy] % len(self.order)]
        return (1.0 if K == target else 100.0) * (1.0 if self.strategy in (None, key.strategy) else 2.0)


#: a K order with switches up and down, runs at K = 0 shorter than the probe interval, the largest K
ORDER = [0, 3, 0, 8, 1, 0, 0, 5, 2, 8, 0, 4, 7, 6]
