"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with
Multiple Decoding Heads"): extra decoding heads on the target's final hidden state.

With the target's final hidden state h_t (the position whose LM-head logits chose the pending
token x_{t+1}), Medusa head k (0-based) predicts x_{t+2+k}. So one hidden state drafts a chain
d_1 .. d_K = the top-1 (or a sample) of heads 0 .. K-1, with no draft forward at all.

Each head is its own stack of ``num_layers`` residual SiLU blocks ``x + silu(W x + b)``
(``W``, ``b`` zero-initialised, so a fresh block is the identity) followed by a vocabulary
projection. The projection is either

* owned (``shared_lm_head=False``, Medusa's default): one ``Linear(hidden, vocab)`` per head,
  optionally initialised from the target's LM head (:meth:`MedusaHeads.init_from_lm_head`,
  :meth:`MedusaHeads.from_target`); or
* shared (``shared_lm_head=True``): every head projects with the target's own, frozen LM-head
  weight, plus, per head, an optional vocabulary bias (``vocab_bias``) and an optional
  low-rank correction ``B_k A_k`` of rank ``lm_head_rank`` (``B_k`` zero-initialised). The
  target's weight is not saved with the heads (files stay small); bind it again when loading
  (``from_pretrained(path, target=model)``).

``MedusaDrafter(heads)`` drafts a chain (each head's top-1). ``MedusaDrafter(heads, tree=...)``
drafts a tree of top-k candidates in Medusa's path format (``"default"``, ``"medusa-63"`` or a
list of paths); the target verifies the whole tree in one forward, through attention with a tree
mask and through every SSM layer from each node's parent state (:mod:`specdec.tree`; STree, Wu et
al. 2025), and commits the longest accepted path. Acceptance is greedy or lossless sampling by
default; Medusa's typical acceptance (``acceptance="typical"``) is available and documented as
not distribution-preserving.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..models import ADAPTERS, adapter_for
from ..placement import execution_device, materialized
from ..tree import TreeSpec, make_tree
from ..verify import ACCEPTANCE_MODES, POSTERIOR_ALPHA, POSTERIOR_THRESHOLD, process_logits
from .base import Drafter, unwrapped

__all__ = ["MedusaHeads", "MedusaDrafter", "ResBlock"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "medusa_heads.safetensors"
_FORMAT = 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ResBlock(nn.Module):
    """``x + silu(linear(x))`` with the linear layer zero-initialised: the identity until trained."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def _lm_head_of(lm_head):
    """The LM head itself of ``lm_head`` given as a module with ``.weight``, a tensor (returned as
    it is) or a causal LM (its output embeddings).

    Raises: ValueError for a causal LM without output embeddings; TypeError for anything else
    without a ``.weight`` tensor."""
    if isinstance(lm_head, torch.Tensor):
        return lm_head
    if hasattr(lm_head, "get_output_embeddings") and callable(lm_head.get_output_embeddings):
        emb = lm_head.get_output_embeddings()
        if emb is None:
            raise ValueError(f"{type(lm_head).__name__} has no output embeddings (LM head)")
        lm_head = emb
    if not isinstance(getattr(lm_head, "weight", None), torch.Tensor):
        raise TypeError(f"expected an LM head (a module with .weight [vocab, hidden]), a tensor or a causal LM; "
                        f"got {type(lm_head).__name__}")
    return lm_head


def _lm_head_weight(lm_head) -> torch.Tensor:
    """The ``[V, D]`` weight of an LM head given as for :func:`_lm_head_of`; on ``meta`` when
    accelerate offloaded it (its shape is right; read its values within :func:`_loaded`)."""
    head = _lm_head_of(lm_head)
    return head if isinstance(head, torch.Tensor) else head.weight


def _lm_head_device(lm_head) -> torch.device:
    """The device an LM head given as for :func:`_lm_head_of` computes on: for a causal LM of a
    family specdec supports, its adapter's device (with accelerate's ``device_map`` the one
    execution device of its layers and LM head, whose weights may be on ``meta``); else the LM
    head module's execution device (:func:`specdec.placement.execution_device`), or the weight's
    device.

    Raises: ValueError for a dispatched causal LM whose layout
    :func:`specdec.placement.check_placement` refuses."""
    family = getattr(getattr(lm_head, "config", None), "model_type", None)
    if isinstance(lm_head, torch.nn.Module) and family in ADAPTERS:
        return adapter_for(lm_head).device
    head = _lm_head_of(lm_head)
    if isinstance(head, torch.Tensor):
        return head.device
    dev = execution_device(head)
    return dev if dev is not None else head.weight.device


@contextlib.contextmanager
def _loaded(lm_head):
    """Within the block, yields ``(weight [V, D], bias [V] or None)`` of an LM head given as for
    :func:`_lm_head_of`, loaded on its execution device when accelerate offloaded it (its hook
    drops them again afterwards; tensors taken from them stay valid)."""
    head = _lm_head_of(lm_head)
    if isinstance(head, torch.Tensor):
        yield head, None
        return
    with materialized(head, own=True):
        bias = getattr(head, "bias", None)
        yield head.weight, bias if isinstance(bias, torch.Tensor) else None


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads on a target of hidden size ``hidden_size`` and vocabulary ``vocab_size``.

    Args:
        hidden_size, vocab_size: the target's final hidden size D and vocabulary V.
        num_heads: heads; head k predicts the token k + 2 positions after the hidden state's.
        num_layers: residual SiLU blocks per head (each head has its own).
        shared_lm_head: project with the target's LM-head weight (frozen, not saved) instead of
            one owned ``Linear`` per head; bind it with :meth:`init_from_lm_head`.
        vocab_bias: a trainable ``[V]`` bias per head (zero-initialised).
        lm_head_rank: with ``shared_lm_head``, a per-head low-rank correction of this rank to
            the shared weight (0 = none).

    ``forward(hidden [..., D]) -> logits [..., num_heads, V]``.

    Raises:
        ValueError: non-positive sizes, or ``lm_head_rank`` without ``shared_lm_head``.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1, *,
                 shared_lm_head: bool = False, vocab_bias: bool = False, lm_head_rank: int = 0):
        super().__init__()
        for name, val, lo in (("hidden_size", hidden_size, 1), ("vocab_size", vocab_size, 1),
                              ("num_heads", num_heads, 1), ("num_layers", num_layers, 0),
                              ("lm_head_rank", lm_head_rank, 0)):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ValueError(f"MedusaHeads: {name} must be an int >= {lo}, got {val!r}")
        if lm_head_rank and not shared_lm_head:
            raise ValueError("MedusaHeads: lm_head_rank is a low-rank correction of the shared LM head; "
                             "it needs shared_lm_head=True (owned projections are full-rank already)")
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.shared_lm_head = bool(shared_lm_head)
        self.lm_head_rank = int(lm_head_rank)
        self.has_vocab_bias = bool(vocab_bias)
        # each head its own stack (separate instances, not one module repeated)
        self.blocks = nn.ModuleList(
            [nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads)]
        )
        self._shared_head = None  # (shared heads) a weak reference to the LM-head module bound, or None
        if self.shared_lm_head:
            self.lm_heads = None
            # the target's weight: not a parameter (frozen) and not persistent (not saved)
            self.register_buffer("shared_weight", None, persistent=False)
            self.vocab_bias = nn.Parameter(torch.zeros(num_heads, vocab_size)) if vocab_bias else None
            if lm_head_rank:
                self.lora_a = nn.Parameter(torch.randn(num_heads, lm_head_rank, hidden_size) / hidden_size**0.5)
                self.lora_b = nn.Parameter(torch.zeros(num_heads, vocab_size, lm_head_rank))
            else:
                self.lora_a = self.lora_b = None
        else:
            self.lm_heads = nn.ModuleList(
                [nn.Linear(hidden_size, vocab_size, bias=vocab_bias) for _ in range(num_heads)]
            )
            if vocab_bias:
                for lin in self.lm_heads:
                    nn.init.zeros_(lin.bias)
            self.vocab_bias = self.lora_a = self.lora_b = None

    # ----------------------------------------------------------------------------- config
    def config_dict(self) -> dict:
        return {
            "model_type": "medusa_heads", "format": _FORMAT,
            "hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
            "num_heads": self.num_heads, "num_layers": self.num_layers,
            "shared_lm_head": self.shared_lm_head, "vocab_bias": self.has_vocab_bias,
            "lm_head_rank": self.lm_head_rank,
        }

    @property
    def is_bound(self) -> bool:
        """False while shared heads have no LM-head weight to project with."""
        return not self.shared_lm_head or self.shared_weight is not None

    def __getstate__(self):
        state = super().__getstate__()  # (pickled / torch.save'd heads forget the LM-head module they were bound from)
        return {**state, "_shared_head": None}

    def shares_another_head(self, model) -> bool:
        """Whether these heads project with a shared LM head bound from another model's LM-head
        module than ``model``'s (False when owning their projections, or bound from a tensor)."""
        head = self._shared_head() if self.shared_lm_head and self._shared_head is not None else None
        return head is not None and head is not unwrapped(model).get_output_embeddings()

    def check_target(self, *, hidden_size: int | None = None, vocab_size: int | None = None) -> None:
        """Raise ValueError when the heads do not fit a target of this hidden size / vocabulary."""
        if hidden_size is not None and int(hidden_size) != self.hidden_size:
            raise ValueError(
                f"Medusa heads take hidden states of size {self.hidden_size}, but the target's final hidden state "
                f"has size {int(hidden_size)}; the heads were made for another model (train heads for this target "
                "with specdec.experiments.train_medusa or MedusaHeads.from_target(model))"
            )
        if vocab_size is not None and int(vocab_size) != self.vocab_size:
            raise ValueError(
                f"Medusa heads predict a vocabulary of {self.vocab_size} tokens, but the target's has {int(vocab_size)}; "
                "the heads were made for another model or tokenizer"
            )

    # ------------------------------------------------------------------------ LM-head init
    @torch.no_grad()
    def init_from_lm_head(self, lm_head) -> "MedusaHeads":
        """Initialise the vocabulary projections from the target's LM head (a module with
        ``.weight [V, D]``, the weight tensor, or the causal LM itself); returns ``self``.

        Owned projections copy the weight (and the LM head's bias when both have one); shared
        heads keep a reference to it (frozen, not saved). An LM head offloaded by accelerate (its
        weight on ``meta``) is loaded through its hook for this and dropped from the module again
        afterwards; shared heads keep a reference to the loaded weight (held in memory).

        Raises: ValueError when the LM head's shape is not ``[vocab_size, hidden_size]``.
        """
        w = _lm_head_weight(lm_head)
        if w.dim() != 2:
            raise ValueError(f"LM-head weight must be 2-D [vocab, hidden], got shape {tuple(w.shape)}")
        self.check_target(hidden_size=w.shape[1], vocab_size=w.shape[0])
        with _loaded(lm_head) as (w, bias):  # (an LM head offloaded by accelerate: loaded for the copy)
            if self.shared_lm_head:
                head = _lm_head_of(lm_head)  # (the module it projects with, known unless given a tensor)
                self._shared_head = None if isinstance(head, torch.Tensor) else weakref.ref(head)
                ref = next(self.parameters(), None)
                dev = ref.device if ref is not None else _lm_head_device(lm_head)
                dt = ref.dtype if ref is not None else torch.float32
                self.shared_weight = w.detach().to(device=dev, dtype=dt)
            else:
                for lin in self.lm_heads:
                    lin.weight.copy_(w.detach().to(lin.weight.dtype))
                    if lin.bias is not None:
                        if bias is not None:
                            lin.bias.copy_(bias.detach().to(lin.bias.dtype))
                        else:
                            lin.bias.zero_()
        return self

    @classmethod
    def from_target(cls, model, num_heads: int = 4, num_layers: int = 1, **kwargs) -> "MedusaHeads":
        """Fresh heads for the HF causal LM ``model``: sizes from its LM head, projections
        initialised from it (its weight, and its bias where the heads have one), fp32, on the
        device its LM head computes on (for a model dispatched by accelerate, the execution device:
        an offloaded LM head's weights are on ``meta`` and are loaded for the copy). ``kwargs``:
        ``shared_lm_head``, ``vocab_bias``, ``lm_head_rank``.

        Raises: ValueError for a dispatched model whose layout
        :func:`specdec.placement.check_placement` refuses."""
        w = _lm_head_weight(model)
        heads = cls(int(w.shape[1]), int(w.shape[0]), num_heads, num_layers, **kwargs).to(_lm_head_device(model))
        return heads.init_from_lm_head(model)

    # ---------------------------------------------------------------------------- forward
    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """Logits of the first ``num_heads`` heads (default all): ``[..., D] -> [..., n, V]``.

        Raises: ValueError on a hidden size other than the heads', or for shared heads with no
        LM-head weight bound."""
        n = self.num_heads if num_heads is None else int(num_heads)
        if not 1 <= n <= self.num_heads:
            raise ValueError(f"num_heads must be in [1, {self.num_heads}], got {num_heads}")
        self.check_target(hidden_size=hidden.shape[-1])
        if not self.is_bound:
            raise ValueError(
                "these Medusa heads project with the target's LM head, which is not saved with them; bind it with "
                "heads.init_from_lm_head(model.lm_head) or MedusaHeads.from_pretrained(path, target=model)"
            )
        lead = hidden.shape[:-1]
        dt = self._dtype()
        x = hidden.reshape(-1, self.hidden_size).to(dt)
        hs = torch.stack([self.blocks[k](x) for k in range(n)], dim=1)  # [N, n, D]
        if self.shared_lm_head:
            logits = hs @ self.shared_weight.t()  # one matmul for every head
            if self.vocab_bias is not None:
                logits = logits + self.vocab_bias[:n]
            if self.lora_a is not None:
                z = torch.einsum("nkd,krd->nkr", hs, self.lora_a[:n])
                logits = logits + torch.einsum("nkr,kvr->nkv", z, self.lora_b[:n])
        else:
            logits = torch.stack([self.lm_heads[k](hs[:, k]) for k in range(n)], dim=1)
        return logits.reshape(*lead, n, self.vocab_size)

    def _dtype(self) -> torch.dtype:
        p = next(self.parameters(), None)
        if p is not None:
            return p.dtype
        return self.shared_weight.dtype if self.shared_weight is not None else torch.float32

    # ------------------------------------------------------------------------------ files
    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` and ``medusa_heads.safetensors`` (the trainable weights, in
        ``dtype`` or their own) into the folder ``path``. A shared LM-head weight is not saved."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in self.state_dict().items()}
        cfg = self.config_dict()
        cfg["dtype"] = str(next(iter(state.values())).dtype).replace("torch.", "") if state else "float32"
        save_file(state, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
        (path / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")

    @classmethod
    def from_pretrained(cls, path: str | Path, *, target=None, lm_head=None, device=None,
                        dtype: torch.dtype = torch.float32) -> "MedusaHeads":
        """Load heads saved by :meth:`save_pretrained`, in ``dtype`` on ``device`` (default: the
        device the target's LM head computes on, its execution device when accelerate dispatched
        it; else CPU).

        Heads with ``shared_lm_head`` need the target's LM head: pass ``target=`` (the HF causal
        LM) or ``lm_head=``; without either they load unbound (call :meth:`init_from_lm_head`).

        Raises:
            FileNotFoundError: no config or weights in ``path``.
            ValueError: a config of another kind, weights that do not match it, a target
                whose hidden size / vocabulary differs from the heads', or a target dispatched by
                accelerate whose layout :func:`specdec.placement.check_placement` refuses.
        """
        from safetensors.torch import load_file

        path = Path(path)
        cfg_path, w_path = path / CONFIG_NAME, path / WEIGHTS_NAME
        if not cfg_path.is_file() or not w_path.is_file():
            raise FileNotFoundError(f"no Medusa heads at {path}: need {CONFIG_NAME} and {WEIGHTS_NAME}")
        cfg = json.loads(cfg_path.read_text())
        if cfg.get("model_type") != "medusa_heads":
            raise ValueError(f"{cfg_path} is not a Medusa heads config (model_type {cfg.get('model_type')!r})")
        if int(cfg.get("format", 0)) > _FORMAT:
            raise ValueError(f"{cfg_path}: format {cfg.get('format')} is newer than this specdec reads ({_FORMAT})")
        heads = cls(int(cfg["hidden_size"]), int(cfg["vocab_size"]), int(cfg["num_heads"]), int(cfg["num_layers"]),
                    shared_lm_head=bool(cfg.get("shared_lm_head", False)), vocab_bias=bool(cfg.get("vocab_bias", False)),
                    lm_head_rank=int(cfg.get("lm_head_rank", 0)))
        state = load_file(str(w_path))
        want = heads.state_dict()
        missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
        bad = sorted(k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape))
        if missing or extra or bad:
            raise ValueError(f"{w_path} does not match {cfg_path}: missing {missing}, unexpected {extra}, "
                             f"wrong shapes {bad}")
        heads.load_state_dict(state)
        source = lm_head if lm_head is not None else target
        if device is None:
            device = _lm_head_device(source) if source is not None else "cpu"
        heads = heads.to(device=device, dtype=dtype)
        if source is not None:
            w = _lm_head_weight(source)
            heads.check_target(hidden_size=w.shape[1], vocab_size=w.shape[0])
            if heads.shared_lm_head:
                heads.init_from_lm_head(source)
        return heads.eval()

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}, num_heads={self.num_heads}, "
                f"num_layers={self.num_layers}, shared_lm_head={self.shared_lm_head}, "
                f"vocab_bias={self.has_vocab_bias}, lm_head_rank={self.lm_head_rank}")


class MedusaDrafter(Drafter):
    """Drafting with Medusa heads on the target's hidden state at the position whose logits chose
    the pending token, as a chain or as a tree of candidates (Cai et al. 2024).

    Chain (``tree=None``): draft j (1-based) is head j-1's top-1 (or a sample of its
    distribution when sampling; :meth:`draft_probs` exposes those distributions, so rejection
    sampling stays lossless). At most ``num_heads`` drafts a step (:attr:`max_drafts`): with a
    larger K the steps run num_heads drafts wide.

    Tree (``tree=...``): node ``p`` of the tree (a path of top-k ranks, Medusa's format) holds
    head ``len(p)-1``'s rank-``p[-1]`` token; the target verifies the whole tree in one forward
    through attention and SSM state (:mod:`specdec.tree`) and commits the longest accepted path.
    ``num_speculative_tokens`` caps the depth (the default tree is rebuilt at that depth; other
    trees drop deeper paths). Candidates are deterministic top-k tokens also when sampling;
    sampling acceptance is then SpecInfer's lossless multi-candidate rejection sampling.

    Args:
        heads: :class:`MedusaHeads` (on the target's device; bound when their LM head is shared).
        tree: None (chain), ``"default"`` (16 nodes: the top-1 chain plus the most likely branches
            of Medusa's ``mc_sim_7b_63``, :func:`specdec.tree.default_tree_paths`), ``"medusa-63"``
            (Medusa's 64-node ``mc_sim_7b_63``), or a list of paths such as
            ``[[0], [0, 0], [1], [0, 1]]`` (:func:`specdec.tree.make_tree`).
        acceptance: ``"exact"`` (default: greedy acceptance, output equal to plain greedy decoding;
            lossless rejection sampling when sampling) or ``"typical"``: Medusa's typical
            acceptance, a candidate is accepted when the target gives it probability above
            ``min(posterior_threshold, posterior_alpha * exp(-entropy))``; the correction token is
            the argmax (greedy) or a sample of the target's distribution without the tokens below
            that threshold. Typical acceptance is NOT distribution-preserving (and with greedy
            decoding its output differs from plain greedy decoding); it accepts more drafts. With
            ``tree=None`` it verifies the chain through the tree path.
        posterior_threshold, posterior_alpha: typical acceptance's epsilon and delta (Medusa's
            defaults 0.09 and 0.3); both in (0, 1].

    Attributes:
        tree: the :class:`specdec.tree.TreeSpec` drafted (for ``tree=None`` with typical
            acceptance, the top-1 chain as a one-branch tree), or None (chain drafting); the
            engine runs tree steps when it is set.

    Raises:
        TypeError: ``heads`` is not a MedusaHeads. ValueError: a bad tree (see
        :func:`specdec.tree.make_tree`), acceptance or threshold; unbound shared heads; and, when
        generation starts, heads that do not fit the target (vocabulary in :meth:`start`, hidden
        size on the first :meth:`observe`) or are on another device.
    """

    wants_hidden_states = True

    def __init__(self, heads: MedusaHeads, tree=None, *, acceptance: str = "exact",
                 posterior_threshold: float = POSTERIOR_THRESHOLD, posterior_alpha: float = POSTERIOR_ALPHA):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"MedusaDrafter needs specdec.drafters.MedusaHeads, got {type(heads).__name__}; load them "
                            "with MedusaHeads.from_pretrained(path, target=model)")
        if not heads.is_bound:
            raise ValueError("these Medusa heads share the target's LM head, which is not bound; load them with "
                             "MedusaHeads.from_pretrained(path, target=model) or call heads.init_from_lm_head(model)")
        if acceptance not in ACCEPTANCE_MODES:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE_MODES}, got {acceptance!r}")
        for name, val in (("posterior_threshold", posterior_threshold), ("posterior_alpha", posterior_alpha)):
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 < val <= 1:
                raise ValueError(f"{name} must be a number in (0, 1], got {val!r}")
        self.heads = heads.eval()
        self.max_drafts = heads.num_heads  # (a chain: one draft per head)
        self.acceptance = acceptance
        self.posterior_threshold = float(posterior_threshold)
        self.posterior_alpha = float(posterior_alpha)
        if tree is not None:
            self.tree = make_tree(tree, heads.num_heads, heads.vocab_size)
        elif acceptance == "typical":
            self.tree = TreeSpec([(0,) * d for d in range(1, heads.num_heads + 1)], num_heads=heads.num_heads)
        else:
            self.tree = None
        self._hidden = None
        self._probs = None
        self._batch = 0  # the rows of the call (start)
        self.sampling = None
        self.generator = None

    def check_target(self, model) -> None:
        """Raise ValueError when the heads project with another model's LM head (shared)."""
        if self.heads.shares_another_head(model):
            raise ValueError("these Medusa heads project with another model's LM head (shared_lm_head=True, bound "
                             "from another model object); bind them to this model's: heads.init_from_lm_head(model) "
                             "or MedusaHeads.from_pretrained(path, target=model)")

    @property
    def vocab_size(self) -> int:
        return self.heads.vocab_size

    @property
    def device(self) -> torch.device:
        p = next(self.heads.parameters(), None)
        return p.device if p is not None else self.heads.shared_weight.device

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        self.heads.check_target(vocab_size=target_vocab_size)
        if torch.device(device) != self.device:
            raise ValueError(f"Medusa heads are on {self.device} but the target is on {torch.device(device)}; "
                             "move them with heads.to(device)")
        self.sampling = sampling
        self.generator = generator
        self._probs = None
        self._batch = batch_size
        # the engine may observe the prompt's hidden state before start(): keep it when it fits
        if self._hidden is not None and self._hidden.shape[0] != batch_size:
            self._hidden = None

    def observe(self, hidden_states: torch.Tensor) -> None:
        self._check_observed("observe", hidden_states)
        self._hidden = hidden_states.detach()

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests) -> None:
        """Rows ``rows`` take new prompts (see :meth:`Drafter.admit`): their hidden state becomes
        ``hidden_states [n, D]``, the target's at each prompt's last position; the other rows keep
        theirs (before the first :meth:`observe` of the call, zeros).

        Raises: ValueError for hidden states of another shape or hidden size."""
        self._check_observed("admit", hidden_states)
        B, D = self._batch, hidden_states.shape[-1]
        if self._hidden is None or self._hidden.shape != (B, D):
            hidden = hidden_states.new_zeros(B, D)
        else:
            hidden = self._hidden.clone()
        hidden[rows] = hidden_states.detach().to(hidden.dtype)
        self._hidden = hidden

    def _check_observed(self, what: str, hidden_states) -> None:
        if hidden_states is None or hidden_states.dim() != 2:
            got = None if hidden_states is None else tuple(hidden_states.shape)
            raise ValueError(f"{what}() takes the target's hidden states [B, D], got {got}")
        self.heads.check_target(hidden_size=hidden_states.shape[-1])

    def draft_probs(self):
        return self._probs

    @torch.no_grad()
    def propose(self, input_ids, lengths, num_speculative_tokens):
        self._check_hidden(input_ids)
        B, K = input_ids.shape[0], int(num_speculative_tokens)
        n = min(K, self.heads.num_heads)
        logits = self.heads(self._hidden.to(self.device), num_heads=n).float()  # [B, n, V]
        drafts = torch.zeros(B, K, dtype=torch.long, device=input_ids.device)
        if self.sampling is None:
            drafts[:, :n] = logits.argmax(-1).to(drafts.device)
            self._probs = None
        else:
            probs = process_logits(logits, self.sampling)  # [B, n, V]
            tok = torch.multinomial(probs.reshape(B * n, -1), 1, generator=self.generator).reshape(B, n)
            drafts[:, :n] = tok.to(drafts.device)
            if n < K:  # rows never use positions past n; pad to [B, K, V]
                probs = torch.cat([probs, probs[:, -1:].expand(B, K - n, probs.shape[-1])], dim=1)
            self._probs = probs
        return drafts, torch.full((B,), n, dtype=torch.long, device=input_ids.device)

    @torch.no_grad()
    def propose_tree(self, input_ids, lengths, tree):
        """Node tokens of ``tree`` (a :class:`specdec.tree.TreeSpec` of depth <= num_heads):
        ``[B, N-1]`` int64, node j+1's token = the rank ``tree.paths[j][-1]`` token of head
        ``len(tree.paths[j]) - 1`` on the observed hidden state (deterministic top-k, also when
        sampling). ``input_ids`` / ``lengths`` as in :meth:`propose` (unused: the heads read the
        hidden state)."""
        hidden = self._check_hidden(input_ids)
        if tree.max_depth > self.heads.num_heads:
            raise ValueError(f"a tree of depth {tree.max_depth} needs {tree.max_depth} Medusa heads, these have "
                             f"{self.heads.num_heads}")
        logits = self.heads(hidden.to(self.device), num_heads=tree.max_depth).float()  # [B, D, V]
        self._probs = None
        return tree.node_tokens(logits).to(input_ids.device)

    def _check_hidden(self, input_ids):
        if self._hidden is None:
            raise RuntimeError("MedusaDrafter.propose() before observe(): the engine must pass the target's hidden "
                               "state (Drafter.wants_hidden_states)")
        if self._hidden.shape[0] != input_ids.shape[0]:
            raise RuntimeError(f"MedusaDrafter: observed hidden states for {self._hidden.shape[0]} rows, asked to propose "
                               f"for {input_ids.shape[0]}")
        return self._hidden

    def __repr__(self):
        h = self.heads
        extra = f", tree={self.tree!r}" if self.tree is not None else ""
        if self.acceptance != "exact":
            extra += f", acceptance={self.acceptance!r}"
        return (f"MedusaDrafter(num_heads={h.num_heads}, num_layers={h.num_layers}, hidden_size={h.hidden_size}"
                f"{extra})")
