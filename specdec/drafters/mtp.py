"""Native multi-token prediction (MTP): the draft layers hybrid checkpoints ship under ``mtp.*``.

Qwen3.5 / Qwen3.5-MoE / Qwen3-Next and Nemotron-H (Nemotron 3) checkpoints carry one or more MTP
layers next to the target's weights (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", section
2.2; served as the default drafter by vLLM ``qwen3_next_mtp`` / ``qwen3_5_mtp`` /
``nemotron_h_mtp`` and SGLang NEXTN). transformers drops them at load time; :class:`MTPDrafter`
reads them back from the checkpoint and drafts with them.

One MTP step at sequence position t fuses the target's final hidden state h_t (the LM head's
input) with the embedding of the next token x_{t+1} and predicts x_{t+2}::

    u = W_fc [norm_e(embed(x_{t+1})) ; norm_h(h_t)]       (embedding first, then the hidden state)
    o = norm_out(layer(u))                                 (a full-attention decoder layer)
    logits = lm_head(o)

with the target's own embedding and LM head (shared: references, never copies). Layouts, with
the names public checkpoints use (after the ``mtp.`` prefix):

* Qwen3.5 / Qwen3.5-MoE / Qwen3-Next (``mtp_num_hidden_layers`` layers): ``pre_fc_norm_embedding``,
  ``pre_fc_norm_hidden``, ``fc`` ([hidden, 2 * hidden]), ``layers.{i}.*`` (the family's own decoder
  layer as a full-attention layer, MoE included; experts per expert, ``experts.{e}.gate_proj``,
  or fused, ``experts.gate_up_proj``), ``norm``. The norms are the family's RMSNorm: Gemma-style
  ``x * (1 + w)`` with zero-initialised ``w``. Step k uses layer ``(k - 1) mod n``.
* Nemotron-H (``num_nextn_predict_layers`` steps of ``mtp_layers_block_type`` blocks each, e.g.
  attention then MoE): ``layers.{j}.*`` are the family's own blocks; the first block of a step
  also holds ``enorm`` (embedding), ``hnorm`` (hidden state) and ``eh_proj``, the last one
  ``final_layernorm``. Step k uses the blocks of step ``(k - 1) mod n``.

Drafting K tokens for a row whose text ends with the pending token x_L: step 1 runs the entry
(h_{L-1}, x_L); step k > 1 runs (o of step k - 1, d_{k-1}), the MTP's own output in place of the
target's hidden state. The MTP attention keeps its own KV cache over the sequence (a
:class:`~specdec.cache.HybridCache`: attention only, rolled back by truncation): entry t sits at
position t. The prompt fills it at the first proposal (entry t = (h_t, x_{t+1}) for every prompt
position but the last); after each target step the engine hands over the target's hidden states
of every committed position (:meth:`MTPDrafter.observe_tokens`) and the next proposal first runs
those entries (with the target's states, so the cache never holds a state the MTP guessed) and
commits them; the speculative entries of steps k > 1 are never committed. In continuous
batching (:meth:`MTPDrafter.admit`) a row that takes a new request gets the new prompt's entries
in its rows of the cache, the other rows keeping theirs. With several MTP
layers, each layer's KV buffer holds the entries that layer ran: the committed entries fill
layer 0's; a layer j > 0 sees its own speculative entries (and older, stale ones).

Drafting is a chain (greedy, or sampled with :meth:`draft_probs` as q for lossless rejection
sampling) or a draft tree in Medusa's path format (``tree=``): the chain of top-1 tokens is run
and node ``p`` holds the rank ``p[-1]`` token of step ``len(p)``'s distribution, as Medusa heads
fill a tree. On the engine's static / CUDA-graph decode path each proposal after the first is
one fixed-shape program (the catch-up on K + 1 entries, then the K - 1 steps), captured as a CUDA
graph on CUDA (greedy and trees) through :func:`specdec.graphs.capture`, its norms and MLPs
fused as the target's are. With K chosen per step (``num_speculative_tokens="auto"``) there is
one such program per K, all on one MTP cache made for the call's largest K, M, and its catch-up
takes M + 1 entries; the entries of plain steps (K = 0) are kept and the next proposal first
catches up on those beyond M + 1 with a captured catch-up program of M + 1 entries per run
(:meth:`MTPDrafter._load_entries`). With ``compile_proposal=True`` the program is compiled whole with
``torch.compile`` before its capture (:class:`specdec.graphs.CapturedProgram`'s
``compile_whole``): a proposal is K passes of a decoder layer at one to K + 1 tokens a row,
hundreds of small kernels (norms, rotary, masks, the KV write, casts) around a few GEMMs, so
the kernels, not its weight bytes, bound it. Compiling takes about a minute per shape (batch,
K, KV bucket) on the first call, which is why it is not the default (BENCH.md has both).

Reduced draft vocabulary (``draft_vocab=``; FR-Spec, Zhao et al. 2025, "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"; EAGLE-3's draft
vocabulary, Li et al. 2025): the K LM-head reads of a proposal are most of its cost at a large
vocabulary (a 248k x 2560 bf16 head is 1.27 GB per read), so the drafter can score only N chosen
tokens, e.g. the N most frequent (:func:`frequent_token_ids`). Their rows of the target's LM head
are copied once, when the drafter is built, into an ``[N, D]`` buffer: that copy is the point,
each step reads N rows contiguously instead of V (it is not refreshed if the target's head
changes later). Drafts are mapped back to the target's ids; verification is unchanged, so greedy
output stays exact (a token outside the set is never drafted, only costs acceptance), and for
sampling the draft distribution q is the drafter's softmax over the N tokens, zero elsewhere,
which keeps rejection sampling lossless (it needs only that drafts are sampled from q).

Random layers (:meth:`MTPDrafter.random`): MTP layers built from the target's config with the
family's own initialisation, for timing a checkpoint shape that has no trained MTP weights.
"""

from __future__ import annotations

import copy
import json
import numbers
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import HybridCache
from ..graphs import CapturedProgram, bucket_length
from ..models import adapter_for
from ..models.common import cache_keyword
from ..placement import materialized
from ..tree import make_tree
from ..verify import process_logits
from .base import Drafter, unwrapped

__all__ = ["MTPDrafter", "MTPLayers", "QwenMTP", "NemotronHMTP", "frequent_token_ids", "mtp_layers_for",
           "read_mtp_tensors", "write_mtp_tensors", "MAX_TREE_DEPTH"]

#: the deepest draft tree an MTP drafter builds (the ``"default"`` tree's depth cap)
MAX_TREE_DEPTH = 16
#: prefixes under which checkpoints store the MTP tensors (multimodal Nemotron-H: ``language_model.``)
_PREFIXES = ("mtp.", "language_model.mtp.")
_INDEX = "model.safetensors.index.json"
_SINGLE = "model.safetensors"


def _mtp_config(config, layer_types: list[str]):
    """A copy of the target's text config whose decoder layers are ``layer_types`` (what the
    family's layer classes read to pick their mixer and MLP)."""
    cfg = copy.deepcopy(config)
    cfg.layer_types = list(layer_types)
    cfg.num_hidden_layers = len(layer_types)
    return cfg


class MTPLayers(nn.Module):
    """The MTP weights of one family (no shared weight: embedding, LM head and rotary embedding are
    the target's, passed in). Subclasses set ``count_field`` (the config field giving the number
    of MTP layers / steps) and build their modules so that :meth:`checkpoint_name` maps each
    state-dict key to its name in the checkpoint (after ``mtp.``).

    ``forward(embeds [B, T, D], hidden [B, T, D], step, position_embeddings=, attention_mask=
    [B, 1, T, S] additive, position_ids=[B, T], cache=)`` returns the normalised MTP output
    ``[B, T, D]`` (the LM head's input and the next step's hidden state) of MTP step ``step + 1``.
    """

    count_field = ""
    #: the checkpoint's fused-expert tensors and the per-expert weights they stack, in order
    _EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "up_proj": ("up_proj",), "down_proj": ("down_proj",)}

    def __init__(self, num_steps: int, hidden_size: int):
        super().__init__()
        self.num_steps = num_steps
        self.hidden_size = hidden_size

    def attention_layers(self) -> dict[int, nn.Module]:
        """``{layer_idx: attention module}`` of every layer that keeps a KV cache."""
        raise NotImplementedError

    def checkpoint_name(self, key: str) -> str:
        """The checkpoint name (after ``mtp.``) of state-dict key ``key``."""
        return key

    @torch.no_grad()
    def init_weights(self, target) -> None:
        """Initialise every weight as transformers initialises the target's family
        (``target._init_weights`` on each module; draws from torch's global generator)."""
        for module in self.modules():
            target._init_weights(module)

    # --- checkpoint layout ---------------------------------------------------------------------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This module's weights under their checkpoint names (``mtp.`` prefix included), with
        mixture-of-experts weights per expert (``experts.{e}.gate_proj.weight``, ...), as public
        checkpoints store them."""
        out = {}
        for key, value in self.state_dict().items():
            name = "mtp." + self.checkpoint_name(key)
            head, _, proj = name.rpartition(".experts.")
            if head and proj in self._EXPERT_PARTS:
                parts = self._EXPERT_PARTS[proj]
                for e, w in enumerate(value):
                    for part, chunk in zip(parts, w.chunk(len(parts), dim=0)):
                        out[f"{head}.experts.{e}.{part}.weight"] = chunk.contiguous()
            else:
                out[name] = value
        return out

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """Load ``tensors`` (checkpoint names without the ``mtp.`` prefix; experts per expert or
        fused) into this module.

        Raises: ValueError naming the missing, unexpected and misshapen tensors and ``source``."""
        tensors = dict(tensors)
        state = self.state_dict()
        names = {self.checkpoint_name(k): k for k in state}
        for name, key in names.items():  # per-expert tensors -> the fused parameter
            head, _, proj = name.rpartition(".experts.")
            if not head or proj not in self._EXPERT_PARTS or name in tensors:
                continue
            per = [[tensors.get(f"{head}.experts.{e}.{part}.weight") for part in self._EXPERT_PARTS[proj]]
                   for e in range(state[key].shape[0])]
            if all(w is not None for ws in per for w in ws):
                try:
                    tensors[name] = torch.stack([torch.cat(ws, dim=0) for ws in per])
                except RuntimeError:  # ragged shapes: reported below as a wrong shape
                    tensors[name] = per[0][0]
                for e in range(len(per)):
                    for part in self._EXPERT_PARTS[proj]:
                        tensors.pop(f"{head}.experts.{e}.{part}.weight")
        missing = sorted(n for n in names if n not in tensors)
        unexpected = sorted(n for n in tensors if n not in names)
        wrong = sorted(f"{n}: {tuple(tensors[n].shape)}, expected {tuple(state[k].shape)}"
                       for n, k in names.items() if n in tensors and tensors[n].shape != state[k].shape)
        if missing or unexpected or wrong:
            raise ValueError(
                f"the MTP tensors in {source} do not fit the config ({self.count_field}={self.num_steps}, "
                f"{type(self).__name__}): missing {['mtp.' + n for n in missing]}, unexpected "
                f"{['mtp.' + n for n in unexpected]}, wrong shapes {['mtp.' + w for w in wrong]}"
            )
        self.load_state_dict({k: tensors[n] for n, k in names.items()})


class QwenMTP(MTPLayers):
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next MTP: ``fc`` over the normalised embedding and hidden
    state, then the family's decoder layer (a full-attention layer; its MLP or MoE as the family
    builds layer ``i``), then ``norm``.

    Args: config: the target's text config. body: the target's decoder body (its layer and norm
        classes are used). num_steps: ``config.mtp_num_hidden_layers``.
    """

    count_field = "mtp_num_hidden_layers"

    def __init__(self, config, body, num_steps: int):
        super().__init__(num_steps, config.hidden_size)
        D, eps = config.hidden_size, config.rms_norm_eps
        norm_cls, layer_cls = type(body.norm), type(body.layers[0])
        cfg = _mtp_config(config, ["full_attention"] * num_steps)
        self.pre_fc_norm_embedding = norm_cls(D, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(D, eps=eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        self.layers = nn.ModuleList([layer_cls(cfg, i) for i in range(num_steps)])
        self.norm = norm_cls(D, eps=eps)
        #: the keyword the decoder layer takes its cache by (:func:`~specdec.models.common.cache_keyword`)
        self.cache_kw = cache_keyword(layer_cls.forward)

    def attention_layers(self):
        return {i: layer.self_attn for i, layer in enumerate(self.layers)}

    def forward(self, embeds, hidden, step: int, *, position_embeddings=None, attention_mask=None, position_ids=None,
                cache=None):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        x = self.layers[step % self.num_steps](x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                               position_ids=position_ids, **{self.cache_kw: cache})
        return self.norm(x)


class NemotronHMTP(MTPLayers):
    """Nemotron-H MTP: per step, ``eh_proj`` over ``enorm(embedding)`` and ``hnorm(hidden)``, the
    family's blocks of ``mtp_layers_block_type`` (e.g. attention, MoE), then ``final_layernorm``.

    Args: config: the target's config. body: its decoder body (block and norm classes).
        num_steps: ``config.num_nextn_predict_layers``.

    Raises: ValueError for a Mamba block in ``mtp_layers_block_type`` (its state is not cached).
    """

    count_field = "num_nextn_predict_layers"

    def __init__(self, config, body, num_steps: int):
        super().__init__(num_steps, config.hidden_size)
        pattern = list(config.mtp_layers_block_type or [])
        if not pattern or "linear_attention" in pattern:
            raise ValueError(f"mtp_layers_block_type={pattern}: MTP drafting supports attention, MoE and MLP blocks")
        D, eps = config.hidden_size, config.layer_norm_epsilon
        norm_cls, block_cls = type(body.norm_f), type(body.layers[0])
        self.pattern = pattern
        cfg = _mtp_config(config, pattern * num_steps)
        self.layers = nn.ModuleList([block_cls(cfg, j) for j in range(len(pattern) * num_steps)])
        self.enorm = nn.ModuleList([norm_cls(D, eps=eps) for _ in range(num_steps)])
        self.hnorm = nn.ModuleList([norm_cls(D, eps=eps) for _ in range(num_steps)])
        self.eh_proj = nn.ModuleList([nn.Linear(2 * D, D, bias=False) for _ in range(num_steps)])
        self.final_layernorm = nn.ModuleList([norm_cls(D, eps=eps) for _ in range(num_steps)])
        #: the keyword the blocks take their cache by (:func:`~specdec.models.common.cache_keyword`)
        self.cache_kw = cache_keyword(block_cls.forward)

    def attention_layers(self):
        return {j: b.mixer for j, b in enumerate(self.layers) if b.block_type == "full_attention"}

    _STEP_PARTS = re.compile(r"^(enorm|hnorm|eh_proj|final_layernorm)\.(\d+)\.(.*)$")

    def checkpoint_name(self, key):
        m = self._STEP_PARTS.match(key)
        if m is None:
            return key
        part, g, rest = m.group(1), int(m.group(2)), m.group(3)
        j = g * len(self.pattern) + (len(self.pattern) - 1 if part == "final_layernorm" else 0)
        return f"layers.{j}.{part}.{rest}"

    def forward(self, embeds, hidden, step: int, *, position_embeddings=None, attention_mask=None, position_ids=None,
                cache=None):
        g = step % self.num_steps
        x = self.eh_proj[g](torch.cat([self.enorm[g](embeds), self.hnorm[g](hidden)], dim=-1))
        P = len(self.pattern)
        for block in self.layers[g * P: (g + 1) * P]:
            mask = attention_mask if block.block_type == "full_attention" else None
            x = block(x, attention_mask=mask, position_ids=position_ids, **{self.cache_kw: cache})
        return self.final_layernorm[g](x)


#: text-config ``model_type`` -> (MTP layers class, whether the rotary embedding takes 3-section mRoPE positions)
_FAMILIES = {
    "qwen3_5_text": (QwenMTP, True),
    "qwen3_5_moe_text": (QwenMTP, True),
    "qwen3_next": (QwenMTP, False),
    "nemotron_h": (NemotronHMTP, False),
}


def _text_parts(target):
    """``(text config, decoder body)`` of a causal LM (the language model of a multimodal one)."""
    config = target.config.get_text_config()
    body = getattr(target, "model", None) or getattr(target, "backbone", None)
    body = getattr(body, "language_model", body)
    return config, body


class _NoLayerCount(ValueError):
    """The target's config declares no MTP layers (its count field unset or 0)."""


def mtp_layers_for(target, num_steps: int | None = None) -> MTPLayers:
    """Fresh (untrained, frozen, eval mode) MTP layers for ``target`` in its dtype and on its device:
    ``num_steps`` layers / steps, default the count the target's config declares.

    Raises: ValueError for a family without a known MTP layout, or a config declaring none (the
        message names the config field)."""
    config, body = _text_parts(target)
    mt = getattr(config, "model_type", None)
    if mt not in _FAMILIES:
        raise ValueError(f"no MTP layout is known for model_type {mt!r}; MTP drafting supports "
                         f"{', '.join(sorted(_FAMILIES))}")
    cls, _ = _FAMILIES[mt]
    if num_steps is not None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, numbers.Integral) or num_steps < 1:
            raise ValueError(f"the number of MTP layers must be an int >= 1, got {num_steps!r}")
    n = int(getattr(config, cls.count_field, 0) or 0) if num_steps is None else int(num_steps)
    if n < 1:
        raise _NoLayerCount(f"{type(target).__name__}'s config declares no MTP layers ({cls.count_field}="
                         f"{getattr(config, cls.count_field, None)}): a checkpoint that ships them sets it to their "
                         "layer count")
    if getattr(config, "mtp_use_dedicated_embeddings", False):
        raise ValueError("mtp_use_dedicated_embeddings=True: MTP layers with their own embedding are not supported")
    p = target.get_output_embeddings().weight  # (its dtype; its device may be meta under accelerate's offloading)
    return cls(config, body, n).to(device=adapter_for(target).device, dtype=p.dtype).eval().requires_grad_(False)


# ------------------------------------------------------------------------------ checkpoint files


def _checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of the folder ``path`` that hold ``mtp.*`` tensors (with an index, the
    shards it maps them to; else the one file).

    Raises: FileNotFoundError for a folder without a checkpoint, or an index naming a shard that
        is not there."""
    if (path / _INDEX).is_file():
        weight_map = json.loads((path / _INDEX).read_text())["weight_map"]
        files = sorted({path / f for k, f in weight_map.items() if k.startswith(_PREFIXES)})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{path / _INDEX} maps the MTP tensors ({' / '.join(p + '*' for p in _PREFIXES)}) "
                                    f"to {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} not in {path}")
        return files
    if (path / _SINGLE).is_file():
        return [path / _SINGLE]
    raise FileNotFoundError(f"no safetensors checkpoint in {path}: expected {_SINGLE} or {_INDEX}")


def _holds_mtp_tensors(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` holds ``mtp.*`` tensors (their names read, not their data)."""
    from safetensors import safe_open

    for f in _checkpoint_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            if any(k.startswith(_PREFIXES) for k in st.keys()):
                return True
    return False


def read_mtp_tensors(path, device=None, dtype=None) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors of the checkpoint folder ``path`` (``model.safetensors``, or the shards
    ``model.safetensors.index.json`` lists), under their names after ``mtp.``; read from the files
    that hold them only.

    Raises: FileNotFoundError when the folder holds no safetensors checkpoint, or its index names a
        shard that is not there."""
    from safetensors import safe_open

    out = {}
    for f in _checkpoint_files(Path(path)):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for key in st.keys():
                for prefix in _PREFIXES:
                    if key.startswith(prefix):
                        out[key[len(prefix):]] = st.get_tensor(key).to(device=device, dtype=dtype)
    return out


def write_mtp_tensors(layers: MTPLayers, path, dtype=None, config_fields: dict | None = None) -> None:
    """Add ``layers``' tensors (``mtp.*``, public layout, in ``dtype`` or their own) to the
    checkpoint folder ``path`` and set the config fields a checkpoint with MTP layers carries
    (``mtp_num_hidden_layers`` / ``num_nextn_predict_layers``, Nemotron-H's
    ``mtp_layers_block_type``, and ``config_fields``, e.g. the MoE sizes the layers were built
    with). A single ``model.safetensors`` is rewritten with them; a sharded checkpoint gets one
    more shard, listed in its index. Earlier ``mtp.*`` tensors are replaced."""
    from safetensors.torch import load_file, save_file

    path = Path(path)
    new = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in layers.checkpoint_tensors().items()}
    if (path / _INDEX).is_file():
        index = json.loads((path / _INDEX).read_text())
        wm = {k: f for k, f in index["weight_map"].items() if not k.startswith(_PREFIXES)}
        save_file(new, str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        wm.update({k: "model-mtp.safetensors" for k in new})
        index["weight_map"] = dict(sorted(wm.items()))
        (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")
    else:
        state = {k: v for k, v in load_file(str(path / _SINGLE)).items() if not k.startswith(_PREFIXES)}
        save_file({**state, **new}, str(path / _SINGLE), metadata={"format": "pt"})
    cfg_path = path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    text = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
    text.update(config_fields or {})
    text[layers.count_field] = layers.num_steps
    if isinstance(layers, NemotronHMTP):
        text["mtp_layers_block_type"] = list(layers.pattern)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# ------------------------------------------------------------------------------ draft vocabulary


def frequent_token_ids(n: int, *, counts: torch.Tensor | None = None, tokens: torch.Tensor | None = None,
                       vocab_size: int | None = None) -> torch.Tensor:
    """The ``n`` most frequent token ids, for :class:`MTPDrafter`'s ``draft_vocab`` (FR-Spec's
    frequency-ranked draft vocabulary).

    Args:
        n: how many ids, ``1 <= n <= V``.
        counts: ``[V]`` per-token counts or frequencies (any real dtype, >= 0); or
        tokens: integer ids of any shape (e.g. a tokenised corpus), counted over ``vocab_size`` ids.

    Returns: LongTensor ``[n]``, ascending, on the input's device. Ties rank the lower id first,
    so ids never seen fill the set from id 0 up.

    Raises:
        ValueError: neither or both of ``counts`` / ``tokens``; ``tokens`` without ``vocab_size``
            or with ids outside ``[0, vocab_size)``; ``counts`` not 1-D or negative; ``n`` out
            of range. TypeError: ``tokens`` not an integer tensor.
    """
    if (counts is None) == (tokens is None):
        raise ValueError("frequent_token_ids() takes counts=[V] token counts or tokens=<token ids>, exactly one")
    if tokens is not None:
        tokens = torch.as_tensor(tokens)
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise TypeError(f"tokens must be integer token ids, got dtype {tokens.dtype}")
        if vocab_size is None:
            raise ValueError("frequent_token_ids(tokens=...) needs vocab_size (the ids to rank)")
        flat = tokens.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab_size):
            raise ValueError(f"tokens hold ids outside [0, {vocab_size}): min {int(flat.min())}, max {int(flat.max())}")
        counts = torch.bincount(flat, minlength=vocab_size)
    counts = torch.as_tensor(counts)
    if counts.dim() != 1 or counts.numel() == 0:
        raise ValueError(f"counts must be 1-D [V] per-token counts, got shape {tuple(counts.shape)}")
    if bool((counts < 0).any()):
        raise ValueError("counts must be >= 0")
    V = counts.numel()
    if not 1 <= int(n) <= V:
        raise ValueError(f"n must be in [1, {V}] (the vocabulary), got {n}")
    order = torch.sort(counts, descending=True, stable=True).indices  # stable: ties keep the lower id first
    return order[: int(n)].sort().values


def _check_draft_vocab(ids, vocab_size: int) -> torch.Tensor:
    """``ids`` as a LongTensor ``[N]`` of distinct ids in ``[0, vocab_size)``, ascending.

    Raises: TypeError for a non-integer tensor; ValueError for another shape, no ids, ids out of
        range or repeated ids (each message names the offending ids)."""
    ids = torch.as_tensor(ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"draft_vocab must be integer token ids (a LongTensor [N]), got dtype {ids.dtype}")
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"draft_vocab must be a non-empty 1-D tensor of token ids [N], got shape {tuple(ids.shape)}")
    ids = ids.long()
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise ValueError(f"draft_vocab holds ids outside the target's vocabulary [0, {vocab_size}): "
                         f"{bad[:8].tolist()}")
    ids = ids.sort().values
    repeated = ids[1:][ids[1:] == ids[:-1]].unique()
    if repeated.numel():
        raise ValueError(f"draft_vocab lists ids more than once: {repeated[:8].tolist()}")
    return ids


# ------------------------------------------------------------------------------ the drafter


class MTPDrafter(Drafter):
    """Draft with the target's own MTP layers (see the module docstring).

    Args:
        target: the loaded HF causal LM (its embedding and LM head are shared).
        layers: its :class:`MTPLayers` (from :meth:`from_pretrained`, or :func:`mtp_layers_for`
            with weights loaded), on the target's device and in its dtype.
        tree: None (chain drafting), ``"default"``, ``"medusa-63"`` or a list of paths in Medusa's
            format (:func:`specdec.tree.make_tree`; depth <= :data:`MAX_TREE_DEPTH`): node ``p``
            holds the rank ``p[-1]`` token of MTP step ``len(p)`` along the top-1 chain.
        draft_vocab: None (draft over the whole vocabulary) or the ids to draft over, a
            LongTensor ``[N]`` of distinct ids in ``[0, V)`` (any order; e.g.
            :func:`frequent_token_ids`): the LM head's N rows are copied into an ``[N, D]``
            buffer now, each step scores only them (see the module docstring). A tree's ranks
            must be < N.
        compile_proposal: on the CUDA-graph path, compile each proposal program whole with
            ``torch.compile`` before capturing it (see the module docstring): a faster proposal
            after about a minute of compiling per shape; a failed compile is reported in
            ``compile_error`` and the proposal is captured uncompiled. ``SPECDEC_FUSE=0`` (no
            fusion at all, :mod:`specdec.fusion`) turns it off too.

    Raises: TypeError for layers of another type, non-integer ``draft_vocab`` or a non-bool
        ``compile_proposal``; ValueError for
        layers on another device or of another hidden size than the target's, a bad tree, or a
        ``draft_vocab`` that is empty, not 1-D, out of range or repeats ids.
    """

    wants_all_hidden_states = True
    drafts_sequentially = True  # one MTP forward per draft

    def __init__(self, target, layers: MTPLayers, tree=None, draft_vocab=None, compile_proposal: bool = False):
        if not isinstance(compile_proposal, bool):
            raise TypeError(f"compile_proposal must be a bool, got {type(compile_proposal).__name__}")
        if not isinstance(layers, MTPLayers):
            raise TypeError(f"MTPDrafter needs specdec.drafters.mtp.MTPLayers, got {type(layers).__name__}; load "
                            "them with MTPDrafter.from_pretrained(path, target=model)")
        self.adapter = adapter_for(target)
        config, body = _text_parts(target)
        self.target = target
        self.layers = layers.eval()
        self.embed = target.get_input_embeddings()
        _, mrope = _FAMILIES[config.model_type]
        self._rotary = getattr(body, "rotary_emb", None)
        self._mrope = mrope
        if layers.hidden_size != config.hidden_size:
            raise ValueError(f"the MTP layers have hidden size {layers.hidden_size}, the target {config.hidden_size}")
        w = next(layers.parameters())
        if w.device != self.adapter.device or w.dtype != self.adapter.dtype:
            raise ValueError(f"the MTP layers are {w.dtype} on {w.device}, the target {self.adapter.dtype} on "
                             f"{self.adapter.device}; load them with MTPDrafter.from_pretrained(path, target=model)")
        #: the ids drafted over, LongTensor [N] ascending on the target's device (None: all V)
        self.draft_vocab = None
        self._head_weight = self._head_bias = None  # the LM head's rows of draft_vocab, [N, D] / [N]
        if draft_vocab is not None:
            ids = _check_draft_vocab(draft_vocab, self.adapter.vocab_size).to(self.adapter.device)
            head = target.get_output_embeddings()
            self.draft_vocab = ids
            with materialized(head, own=True):  # (an LM head offloaded by accelerate: loaded for the copy)
                self._head_weight = head.weight.detach().index_select(0, ids)  # a copy: N contiguous rows
                if getattr(head, "bias", None) is not None:
                    self._head_bias = head.bias.detach().index_select(0, ids)
        drafted = self.adapter.vocab_size if self.draft_vocab is None else self.draft_vocab.numel()
        self.tree = make_tree(tree, MAX_TREE_DEPTH, drafted) if tree is not None else None
        #: compile each captured proposal whole before capturing it (see the class)
        self.compile_proposal = compile_proposal
        self._path = "eager"
        self._adaptive = False  # K changes per step: the fixed-K static program does not apply
        self._max_k = 0  # the call's largest K (set_speculation): the eager cache holds steps of it
        self._static = None  # _StaticMTP of the current shape bucket (static / CUDA-graph path)
        #: how the last proposal ran: "eager", "static" or "cuda_graph"
        self.last_path = "eager"
        #: why the proposal's CUDA-graph capture failed (its error; with K chosen per step, each
        #: program of the bucket that failed, named: it runs uncaptured from then on), or None
        self.capture_error: str | None = None
        #: with ``compile_proposal``: why compiling the captured proposal as one ``torch.compile``
        #: graph failed (it then runs with fused norms / MLPs only), or None
        self.compile_error: str | None = None
        self._reset()

    @classmethod
    def from_pretrained(cls, path, *, target, tree=None, draft_vocab=None, compile_proposal=False) -> "MTPDrafter":
        """The MTP layers of the checkpoint folder ``path`` (one ``model.safetensors`` or shards with
        ``model.safetensors.index.json``), built from ``target``'s config with its family's layer
        classes, in its dtype on its device; ``tree``, ``draft_vocab``, ``compile_proposal`` as in the class.

        Raises:
            FileNotFoundError: ``path`` is not a folder with a safetensors checkpoint.
            ValueError: a family without an MTP layout, a config declaring no MTP layers, no
                ``mtp.*`` tensors in the files, or tensors that do not fit the config (each
                message names what was looked for and where).
        """
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"MTP layers are read from a checkpoint folder; {str(path)!r} is not one")
        try:
            layers = mtp_layers_for(target)
        except _NoLayerCount as err:  # a config without the count: say whether the files hold MTP tensors
            if not _holds_mtp_tensors(path):  # (a ValueError, as documented: not the private class)
                raise ValueError(f"{err}, and {path} holds no mtp.* tensors: this checkpoint ships no MTP head. "
                                 "Use another drafter (drafter='ngram', a DraftModelDrafter, or MedusaHeads trained for "
                                 "the model); MTPDrafter.random(model) builds untrained MTP layers, for timing only") from None
            raise ValueError(f"{err}; the checkpoint in {path} holds MTP tensors, so its config.json lacks that "
                             "field") from None
        files = ", ".join(str(f) for f in _checkpoint_files(path)) or f"{path / _INDEX} (no shard holds mtp.*)"
        tensors = read_mtp_tensors(path, device=adapter_for(target).device, dtype=target.get_output_embeddings().weight.dtype)
        if not tensors:
            raise ValueError(f"no MTP tensors (names starting with {' or '.join(_PREFIXES)}) in {files}; "
                             f"the config declares {layers.count_field}={layers.num_steps}")
        layers.load_checkpoint_tensors(tensors, files)
        return cls(target, layers, tree=tree, draft_vocab=draft_vocab, compile_proposal=compile_proposal)

    @classmethod
    def random(cls, target, num_layers: int = 1, seed: int = 0, *, tree=None, draft_vocab=None,
               compile_proposal=False) -> "MTPDrafter":
        """MTP layers with random weights, for timing a checkpoint shape that ships none: built
        from ``target``'s config as :func:`mtp_layers_for` builds them (``num_layers`` layers /
        steps; Nemotron-H: the blocks of ``config.mtp_layers_block_type``, transformers' default
        attention then MoE with the config's MoE sizes), initialised as transformers initialises
        the family (:meth:`MTPLayers.init_weights`) from ``torch.manual_seed(seed)`` without
        changing the caller's random state. Its drafts are accepted about as often as random
        tokens: use it for speed, not acceptance. ``tree``, ``draft_vocab``, ``compile_proposal`` as in
        the class.

        Raises: ValueError as :func:`mtp_layers_for` (a family without an MTP layout,
            ``num_layers < 1``) and as the class."""
        dev = adapter_for(target).device
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            torch.manual_seed(int(seed))
            layers = mtp_layers_for(target, num_steps=num_layers)
            layers.init_weights(target)
        return cls(target, layers, tree=tree, draft_vocab=draft_vocab, compile_proposal=compile_proposal)

    @classmethod
    def for_model(cls, target, tree=None, draft_vocab=None, compile_proposal=False) -> "MTPDrafter":
        """:meth:`from_pretrained` on the folder the target was loaded from
        (``target.config._name_or_path``: a local folder, or a hub id whose files are fetched
        through ``huggingface_hub``: only the index and the shards holding ``mtp.*``).

        Raises: ValueError when the model records no checkpoint (built in memory), and the errors
            of :meth:`from_pretrained`."""
        name = getattr(target.config, "_name_or_path", "") or ""
        if not name:
            raise ValueError(f"drafter='mtp' reads the MTP layers from the checkpoint {type(target).__name__} was "
                             "loaded from, but this model records none (config._name_or_path is empty); use "
                             "MTPDrafter.from_pretrained(path, target=model)")
        if not Path(name).is_dir():
            name = _fetch_hub_mtp_files(name)
        return cls.from_pretrained(name, target=target, tree=tree, draft_vocab=draft_vocab,
                                   compile_proposal=compile_proposal)

    def proposal_bytes(self, num_speculative_tokens: int) -> int:
        """The bytes a chain proposal of ``num_speculative_tokens`` (K) drafts must read at least: the
        MTP layers' weights once, and K reads of the LM-head rows it drafts over (all V rows, or
        ``draft_vocab``'s N) with their bias. Over the device's copy bandwidth this is the
        proposal's floor (the embedding's K + 1 rows are left out: a few KB)."""
        layers = sum(p.numel() * p.element_size() for p in self.layers.parameters())
        if self._head_weight is not None:
            rows = [self._head_weight] + ([self._head_bias] if self._head_bias is not None else [])
        else:
            head = self.target.get_output_embeddings()
            rows = [head.weight] + ([head.bias] if getattr(head, "bias", None) is not None else [])
        return layers + int(num_speculative_tokens) * sum(t.numel() * t.element_size() for t in rows)

    # --- Drafter interface --------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.adapter.vocab_size

    def check_target(self, model) -> None:
        """Raise ValueError unless ``model`` is the target this drafter was made for (it drafts
        with that model's embedding and LM head)."""
        if unwrapped(model) is not unwrapped(self.target):
            raise ValueError("this MTP drafter was made for another model object than the generator's and would draft "
                             "with that model's embedding and LM head; make it for this model: drafter='mtp', "
                             "MTPDrafter.for_model(model), MTPDrafter.from_pretrained(path, target=model) or "
                             "MTPDrafter.random(model, ...)")

    def set_decode_path(self, path: str) -> None:
        self._path = path

    def set_speculation(self, max_speculative_tokens: int, adaptive: bool) -> None:
        self._adaptive = bool(adaptive)
        self._max_k = int(max_speculative_tokens)

    @property
    def _static_proposals(self) -> bool:
        """Whether proposals run fixed-shape programs (the static / CUDA-graph path): one for a
        fixed K, one per K with K chosen per step (trees: a fixed K only)."""
        return self._path != "eager" and not (self._adaptive and self.tree is not None)

    @property
    def _direct(self) -> bool:
        """Whether observed entries go straight into the program's buffers (a fixed K: every step
        proposes, so they are never more than K + 1); with K chosen per step they are kept
        (:meth:`_append_entries`) until a proposal loads them (:meth:`_load_entries`)."""
        return self._static_proposals and not self._adaptive

    def _reset(self):
        self.cache = None
        self._prompt = None  # (hidden [B, L, D], attention_mask [B, L]) until the first proposal
        # [B, R, D] target hidden states of the entries the next proposal runs first, [B] how many:
        # every committed position's since the last proposal (steps at K = 0 ask for none)
        self._hidden = None
        self._num = None
        self._used = 0  # columns of _hidden that may hold entries (host bound: max(_num) <= it)
        self._probs = None
        self._calls = 0
        self._batch = 0  # the rows of the call (start)
        self.sampling = None
        self.generator = None
        self.max_length = None

    def start(self, *, target_vocab_size, batch_size, device, sampling=None, generator=None, max_length=None):
        self._reset()
        if target_vocab_size != self.vocab_size:
            raise ValueError(f"the MTP layers draft over {self.vocab_size} tokens, the target has {target_vocab_size}")
        if torch.device(device) != self.adapter.device:
            raise ValueError(f"the MTP layers are on {self.adapter.device} but the target is on {torch.device(device)}")
        self.sampling, self.generator, self.max_length = sampling, generator, max_length
        self._batch = batch_size

    @staticmethod
    def _check_prompt(what: str, hidden_states, attention_mask) -> None:
        if hidden_states is None or hidden_states.dim() != 3 or hidden_states.shape[:2] != attention_mask.shape:
            got = None if hidden_states is None else tuple(hidden_states.shape)
            raise ValueError(f"{what}() takes the target's hidden states [B, L, D] of every prompt position and a "
                             f"mask [B, L], got {got} and {tuple(attention_mask.shape)}")

    def observe_prompt(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> None:
        self._check_prompt("observe_prompt", hidden_states, attention_mask)
        self._prompt = (hidden_states, attention_mask)

    def admit(self, rows, input_ids, attention_mask, hidden_states, requests) -> None:
        """Rows ``rows`` take the prompts ``input_ids [n, L]`` (left-padded, ``attention_mask``)
        whose target hidden states are ``hidden_states [n, L, D]`` (see :meth:`Drafter.admit`).

        Before the first proposal they replace those rows' prompts in what the first proposal
        prefills. After it, the rows of the MTP cache are reset to the new prompts' entries
        (:meth:`HybridCache.reset_rows`, in place, so a captured proposal program stays valid:
        prefilled as :meth:`observe_prompt`'s prompts are, into a cache of ``n`` rows), the other
        rows' untouched, and the next proposal catches each row up from its last prompt
        position's hidden state, as after a prefill.

        Raises: ValueError for hidden states of another shape than ``[n, L, D]``.
        """
        self._check_prompt("admit", hidden_states, attention_mask)
        if self.cache is None:  # no proposal yet: the first one prefills every row's prompt
            self._prompt = self._merge_prompts(rows, hidden_states, attention_mask)
            if self._num is not None:  # (entries observed since: the rows' old requests')
                self._num = self._num.clone()
                self._num[rows] = 0
            return
        cache = self.cache
        cache.set_step_tokens(0)  # the last proposal's speculative entries: never committed
        fresh = self._new_cache(rows.numel(), cache.max_len, cache.max_step_tokens, cache.static)
        last = self._fill(fresh, input_ids, hidden_states, attention_mask)
        cache.reset_rows(rows, fresh)
        st = self._static
        if st is not None and self._direct:  # into the buffers the captured program reads
            st.hidden[rows, :1] = last.to(st.hidden.dtype)
            st.num[rows] = 1
        else:
            if self._hidden is None:  # (nothing observed since the last proposal)
                self._hidden = last.new_zeros(self._batch, 1, last.shape[-1])
                self._num = torch.zeros(self._batch, dtype=torch.long, device=last.device)
                self._used = 1
            self._num = self._num.clone()
            self._hidden[rows, :1] = last.to(self._hidden.dtype)
            self._num[rows] = 1

    def _merge_prompts(self, rows, hidden_states, attention_mask):
        """The prompts the first proposal prefills, ``(hidden [B, W, D], mask [B, W])``, with rows
        ``rows`` set to ``hidden_states [n, L, D]`` / ``attention_mask [n, L]`` (left padding
        widened to the longer of the two)."""
        old_h, old_m = self._prompt if self._prompt is not None else (hidden_states[:0], attention_mask[:0])
        W = max(old_m.shape[1], attention_mask.shape[1])
        hidden = hidden_states.new_zeros(self._batch, W, hidden_states.shape[2])
        mask = attention_mask.new_zeros(self._batch, W)
        if old_m.shape[0]:
            hidden[:, W - old_m.shape[1]:], mask[:, W - old_m.shape[1]:] = old_h, old_m
        hidden[rows], mask[rows] = 0, 0  # (a shorter new prompt: none of the old one's columns kept)
        L = attention_mask.shape[1]
        hidden[rows, W - L:], mask[rows, W - L:] = hidden_states, attention_mask
        return hidden, mask

    def observe_tokens(self, hidden_states: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """See :meth:`Drafter.observe_tokens`. Entries observed while no proposal ran (steps at
        K = 0 with K chosen per step, or before the first proposal) are kept, in order, for the
        next proposal to run: the MTP cache then holds every committed position's entry, at its
        own position, as when every step proposes. They are copies (the engine's tensor may be a
        CUDA graph's output, rewritten by its next step), held until that proposal: up to
        B x 2 x (steps since) x D values of the hidden states' dtype; that proposal runs them in
        forwards of at most the cache's spare columns (:meth:`_catch_up_chunk`), on the static
        path of M + 1 entries, M the call's largest K (:meth:`_load_entries`)."""
        st = self._static
        if st is not None and self._direct:  # into the buffers the captured program reads
            st.hidden[:, : hidden_states.shape[1]].copy_(hidden_states)
            st.num.copy_(num_tokens)
        elif self._hidden is None:  # (a copy: the engine's tensor may be a graph's output, rewritten by the next step)
            self._hidden, self._num = hidden_states.clone(), num_tokens.clone()
            self._used = hidden_states.shape[1]
        else:
            self._append_entries(hidden_states, num_tokens)

    def draft_probs(self):
        return self._probs

    @torch.no_grad()
    def propose(self, input_ids, lengths, num_speculative_tokens):
        K = int(num_speculative_tokens)
        out = self._propose(input_ids, lengths, K, self.sampling is None)
        drafts, self._probs = out if self.sampling is not None else (out, None)
        B = input_ids.shape[0]
        return drafts.to(input_ids.device), torch.full((B,), K, dtype=torch.long, device=input_ids.device)

    @torch.no_grad()
    def propose_tree(self, input_ids, lengths, tree):
        """Node tokens ``[B, N-1]`` of ``tree``: the top-1 chain of ``tree.max_depth`` MTP steps, node
        ``p`` = rank ``p[-1]`` of step ``len(p)`` (deterministic top-k, also when sampling).
        ``input_ids`` / ``lengths`` as in :meth:`propose`."""
        self._probs = None
        return self._propose(input_ids, lengths, tree.max_depth, True, tree).to(input_ids.device)

    # --- one proposal -------------------------------------------------------------------------
    def _propose(self, text, lengths, K, greedy, tree=None):
        """Greedy: the drafts ``[B, K]`` (a tree: its node tokens ``[B, N-1]``); sampling:
        ``(drafts [B, K], probs [B, K, V])``."""
        first = self._calls == 0 if self._static_proposals else self.cache is None
        if first and self._prompt is None:
            raise RuntimeError("MTPDrafter.propose() before observe_prompt(): the engine must pass the target's "
                               "prompt hidden states (Drafter.wants_all_hidden_states)")
        pick = self._argmax if greedy else self._sample
        if self._static_proposals:
            return self._propose_static(text, lengths, K, pick, tree)
        self.last_path, self.capture_error, self.compile_error = "eager", None, None  # (no program ran)
        if first:
            top = max(K, self._max_k)
            self.cache = self._new_cache(text.shape[0], self._columns(top, False), top + 1, static=False)
            self._prefill(self.cache, text, lengths)
        elif K + 1 > self.cache.max_step_tokens:  # (its columns hold the steps of the K it was made for)
            raise ValueError(f"num_speculative_tokens grew from at most {self.cache.max_step_tokens - 1} to {K} "
                             "during one generate(); call set_speculation() with the largest K, or start() again")
        if self._hidden is None:
            raise RuntimeError("MTPDrafter.propose() twice without observe_tokens() in between: the engine must hand "
                               "over the committed positions' hidden states after every step")
        width = max(int(self._num.max()), 1)
        hidden, num, self._hidden, self._num = self._hidden[:, :width], self._num, None, None  # (run now)
        return self._chain(self.cache, text, lengths, hidden, num, K, pick, tree, chunk=self._catch_up_chunk(K))

    def _catch_up_chunk(self, K: int) -> int:
        """The most entries one catch-up forward of the eager cache runs: its columns beyond the
        longest text (:meth:`_columns` of the K it was made for) less the K - 1 speculative steps
        after it, so that no row's forward, a finished row's included (it writes the forward's
        width past its end, uncommitted), writes past the cache."""
        spare = self.cache.max_len - max(self.max_length or 0, 1)
        return max(1, spare - max(K - 1, 0))

    def _columns(self, K, static):
        """KV columns of the MTP cache: every entry of the longest text plus a proposal's (a static
        cache: rounded up to its shape bucket, which is also its text buffer's width)."""
        total = max(self.max_length or 0, 1) + 4 * (K + 1)
        return bucket_length(total) if static else total

    def _new_cache(self, B, max_len, max_step_tokens, static):
        """An empty MTP cache of ``B`` rows, ``max_len`` KV columns, steps of ``max_step_tokens``."""
        cache = HybridCache(B, max_len, max_step_tokens, self.adapter.dtype, self.adapter.device, static=static)
        for idx, attn in self.layers.attention_layers().items():
            empty = torch.zeros(B, attn.k_proj.out_features // attn.head_dim, 0, attn.head_dim,
                                dtype=self.adapter.dtype, device=cache.device)
            cache.load_kv(idx, empty, empty)
        return cache

    def _prefill(self, cache, text, lengths):
        """Fill ``cache`` with the observed prompts' entries (:meth:`_fill`; the prompts' tokens read
        from the text); their last positions' entries are the next proposal's first."""
        hidden, mask = self._prompt
        B, Lp = mask.shape
        cols = torch.arange(Lp, device=text.device)[None, :]
        pad = Lp - mask.sum(1).to(text.device)
        ids = text.gather(1, (cols - pad[:, None]).clamp(min=0))  # the prompt, left-padded again
        last, ones = self._fill(cache, ids, hidden, mask), torch.ones(B, dtype=torch.long, device=cache.device)
        observed = (self._hidden, self._num) if self._hidden is not None else None
        self._hidden, self._num, self._used = last.clone(), ones, 1  # (a copy: the prompt's states stay as given)
        if observed is not None:  # the entries of steps that ran before this first proposal follow the prompt's last
            self._append_entries(*observed)
        self._prompt = None

    def _append_entries(self, hidden: torch.Tensor, num: torch.Tensor) -> None:
        """Row b's next ``num[b]`` entries, ``hidden [B, R, D]`` (its first ``num[b]`` columns),
        after the ``_num[b]`` it holds, on the device (no host sync): into a buffer of this
        drafter's, grown twofold when full, so a run of steps that do not propose copies each entry
        about once."""
        B, R = hidden.shape[:2]
        need = self._used + R
        if need > self._hidden.shape[1]:
            buf = self._hidden.new_zeros(B, max(need, 2 * self._hidden.shape[1]), self._hidden.shape[2])
            buf[:, :self._used] = self._hidden[:, :self._used]
            self._hidden = buf
        cols = self._num.view(B, 1, 1)  # < _used + R per row (a step at K = 0, R = 1: two launches a step)
        if R > 1:
            cols = cols + torch.arange(R, device=cols.device).view(1, R, 1)
        self._hidden.scatter_(1, cols.expand(B, R, hidden.shape[2]), hidden.to(self._hidden.dtype))
        self._num.add_(num.to(self._num.device))  # (this drafter's own tensor: a clone, or made by _prefill)
        self._used = need

    def _fill(self, cache, input_ids, hidden, mask) -> torch.Tensor:
        """Fill the empty ``cache`` with the entries (h_t, x_{t+1}) of the left-padded prompts
        ``input_ids [B, L]`` (``mask [B, L]``, target hidden states ``hidden [B, L, D]``) for every
        prompt position but the last, laid out as the target's prompt (left padding kept: entry t
        at column pad + t). Returns the last positions' hidden states ``[B, 1, D]``, whose entries
        (with the pending tokens) the next proposal runs first."""
        Lp = mask.shape[1]
        cache.pad = (Lp - mask.sum(1)).to(cache.device)
        cache.seq_len = torch.zeros_like(cache.pad)
        cache.refresh_mirrors()
        if Lp > 1:
            self._step(cache, input_ids[:, 1:].to(cache.device), hidden[:, :-1], 0)
            cache.commit(torch.full_like(cache.pad, Lp - 1))
        return hidden[:, -1:]

    def _step(self, cache, tokens, hidden, step):
        """One MTP forward (step ``step + 1``) of ``tokens [B, t]`` / ``hidden [B, t, D]`` at the
        cache's next columns; returns the MTP output ``[B, t, D]``."""
        t = tokens.shape[1]
        pos = cache.position_ids(t)
        x = self.embed(tokens)
        if x.device != cache.device:  # (the target's embedding computes on another device than its LM head)
            x = x.to(cache.device)
        out = self.layers(x, hidden.to(x.dtype), step, position_embeddings=self.position_embeddings(x, pos),
                          attention_mask=cache.attention_mask(t, self.adapter.dtype), position_ids=pos, cache=cache)
        cache.advance(t)
        return out

    def position_embeddings(self, x: torch.Tensor, position_ids: torch.Tensor):
        """The target's rotary ``(cos, sin)`` for ``position_ids [B, T]`` (what its decoder layers
        take), or None for a family without rotary embeddings (Nemotron-H)."""
        if self._rotary is None:
            return None
        pos = position_ids[None].expand(3, *position_ids.shape) if self._mrope else position_ids
        cos, sin = self._rotary(x, pos)
        if cos.device != x.device:  # (the target's rotary module computes on another device)
            cos, sin = cos.to(x.device), sin.to(x.device)
        return cos, sin

    def _chain(self, cache, text, lengths, hidden, num, K, pick, tree=None, chunk=None, start=0, last=None):
        """Catch up on the ``num [B]`` entries whose target hidden states are ``hidden [B, R, D]``
        (their tokens: the text's last ``num``; entries before ``start`` already run, ``last``
        their last outputs: see :meth:`_catch_up`) and commit them, in forwards of at most
        ``chunk`` entries (None: one forward), then run K - 1 speculative steps (left open: the
        next proposal discards them). Returns what :meth:`_propose` does."""
        R = hidden.shape[1]
        cache.set_step_tokens(0)  # the previous proposal's speculative entries: never committed
        width = R if chunk is None else min(R, chunk)
        for at in range(0, R, width):  # (host ints: one forward unless the entries outgrow a chunk)
            part = hidden[:, at:at + width]
            if part.shape[1] < width:  # (the last chunk: padded, its columns beyond the counts unused)
                part = torch.cat([part, part.new_zeros(part.shape[0], width - part.shape[1], part.shape[2])], 1)
            last = self._catch_up(cache, text, lengths, part, num, start + at, last)
        logits, toks, probs = [], [], []
        ids = self.draft_vocab
        for k in range(K):
            if k:
                last = self._step(cache, toks[-1][:, None], last[:, None], k)[:, 0]
            step_logits = self.draft_logits(last)
            tok, p = pick(step_logits)
            if ids is not None:  # index in the draft vocabulary -> the target's id
                tok = ids[tok]
            logits.append(step_logits)
            toks.append(tok)
            probs.append(p)
        if tree is not None:
            nodes = tree.node_tokens(torch.stack(logits, dim=1))
            return nodes if ids is None else ids[nodes]
        if probs[0] is not None:
            q = torch.stack(probs, dim=1)
            if ids is not None:  # q over the target's vocabulary: zero outside the draft vocabulary
                q = q.new_zeros(*q.shape[:-1], self.vocab_size).index_copy_(-1, ids, q)
            return torch.stack(toks, dim=1), q
        return torch.stack(toks, dim=1)

    def _catch_up(self, cache, text, lengths, hidden, num, start, last):
        """One forward of each row's entries ``start .. start + W - 1`` of its ``num [B]`` (W =
        ``hidden.shape[1]``; ``hidden [B, W, D]`` their target hidden states, ``start`` an int or a
        0-d long tensor), committed. Returns the MTP output ``[B, D]`` at each row's last entry
        among them, or the row's ``last`` where it has none there (None: the output at column 0)."""
        B, W = hidden.shape[:2]
        j = torch.arange(W, device=cache.device)[None, :]
        n = (num - start).clamp(0, W)
        idx = ((lengths - num + start)[:, None] + j).clamp(0, text.shape[1] - 1)
        out = self._step(cache, text.gather(1, idx), hidden, 0)
        cache.commit(n)
        at = out[torch.arange(B, device=cache.device), (n - 1).clamp(min=0)]
        return at if last is None else torch.where((n > 0)[:, None], at, last)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits ``[..., V]`` of the MTP output ``hidden [..., D]`` through the target's LM
        head, or ``[..., N]`` over ``draft_vocab`` (its rows' copy; the MTP families' heads are
        plain linear layers, so these equal the full logits' columns ``draft_vocab``)."""
        if self._head_weight is None:
            return self.adapter.logits(hidden).float()
        return F.linear(hidden.to(self._head_weight.dtype), self._head_weight, self._head_bias).float()

    def _argmax(self, logits):
        return logits.argmax(-1), None

    def _sample(self, logits):
        probs = process_logits(logits, self.sampling)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0], probs

    # --- static / CUDA-graph path -----------------------------------------------------------
    def _propose_static(self, text, lengths, K, pick, tree):
        """The fixed-shape proposal: catch-up over the entries, then K - 1 steps, on buffers kept
        per shape bucket; greedy proposals run as a :class:`~specdec.graphs.CapturedProgram`
        (a CUDA graph on the ``cuda_graph`` path), sampled ones eagerly. A fixed K: one program
        of K + 1 entries; K chosen per step: one per K, of M + 1 entries (M: the call's largest
        K), after :meth:`_load_entries`.

        Raises: ValueError for a K above the one the buffers were made for."""
        B, W = text.shape
        top = self._max_k if self._adaptive else K  # the K the cache and the buffers are made for
        if K > top:
            raise ValueError(f"num_speculative_tokens={K} is above the largest K of this generate(), {top} "
                             "(set_speculation)")
        width = self._columns(top, static=True)  # >= W: the engine's text never outgrows max_length
        key = (B, top, width, self._path, tree, self._adaptive)
        st = self._static
        if self._calls == 0:
            if st is None or st.key != key:
                D = self.layers.hidden_size
                st = self._static = _StaticMTP(key, B, top, width, D, self.adapter.dtype, self.adapter.device)
            fresh = self._new_cache(B, width, top + 1, static=True)
            self._prefill(fresh, text, lengths)
            if st.cache is None:
                st.cache = fresh
            else:  # into the buffers a captured graph points at
                st.cache.copy_from(fresh)
            if self._direct:
                st.hidden[:, :1].copy_(self._hidden)
                st.num.copy_(self._num)
        self._calls += 1
        self.cache = st.cache
        st.text[:, :W].copy_(text)
        st.lengths.copy_(lengths)
        greedy = pick == self._argmax
        if not self._direct:
            self._load_entries(st, greedy)
        if not greedy:  # sampling: the same fixed-shape steps, never captured
            self.last_path = "static"
            return self._chain(st.cache, st.text, st.lengths, st.hidden, st.num, K, pick, tree, start=st.start,
                               last=st.last)
        program = st.programs.get(K)
        if program is None:
            out = st.outs[K] = torch.zeros(B, K if tree is None else tree.num_nodes - 1, dtype=torch.long,
                                           device=st.num.device)
            last = None if self._direct else st.last  # (a fixed K: every row has entries; an ended row's
            program = st.programs[K] = self._program(  # unused drafts as the eager path makes them)
                st, lambda: out.copy_(self._chain(st.cache, st.text, st.lengths, st.hidden, st.num, K, self._argmax,
                                                  tree, start=st.start, last=last)),
                f"the MTP proposal (K = {K})" if self._adaptive else "the MTP proposal")
        self.last_path = program()
        if self._direct:
            self.capture_error, self.compile_error = program.error, program.compile_error
        else:  # every program of the bucket that failed, the catch-up's included: each runs uncaptured from then on
            runs = [*st.programs.values(), *([st.catch_up] if st.catch_up is not None else [])]
            self.capture_error = "; ".join(f"{p.what}: {p.error}" for p in runs if p.error) or None
            self.compile_error = "; ".join(f"{p.what}: {p.compile_error}" for p in runs if p.compile_error) or None
        return st.outs[K].clone()

    def _program(self, st, fn, what):
        """A :class:`~specdec.graphs.CapturedProgram` of ``fn`` on ``st``'s buffers (the programs of
        one bucket share a graph memory pool: they never run at once and write outside it)."""
        graphs = self._path == "cuda_graph"
        if graphs and st.pool is None:
            st.pool = torch.cuda.graph_pool_handle()
        return CapturedProgram(fn, model=self.layers, what=what, graphs=graphs, compile_whole=self.compile_proposal,
                               pool=st.pool)

    def _load_entries(self, st, captured: bool) -> None:
        """K chosen per step: hand the entries kept since the last proposal to the program's
        buffers (``st.hidden`` holds M + 1 of each row's; ``st.num`` the counts, ``st.start`` the
        first one's index). Runs those beyond the last M + 1 columns first, M + 1 a run, by the
        catch-up program (captured where ``captured``), which commits them and keeps each row's
        last output in ``st.last``."""
        if self._hidden is None:
            raise RuntimeError("MTPDrafter.propose() twice without observe_tokens() in between: the engine must hand "
                               "over the committed positions' hidden states after every step")
        C = st.hidden.shape[1]
        hidden, used = self._hidden, self._used
        st.num.copy_(self._num)
        self._hidden = self._num = None
        self._used = 0
        runs = max(1, -(-used // C))  # (host ints: every column up to _used may hold an entry)
        for r in range(runs):
            part = hidden[:, r * C:(r + 1) * C]
            st.hidden[:, :part.shape[1]].copy_(part)  # (columns past it: the counts leave them unused)
            st.start.fill_(r * C)
            if r < runs - 1:
                if st.catch_up is None:
                    st.catch_up = self._program(st, lambda: self._catch_up_static(st), "the MTP catch-up")
                if captured:
                    st.catch_up()
                else:
                    self._catch_up_static(st)

    def _catch_up_static(self, st) -> None:
        """One catch-up run on ``st``'s buffers (:meth:`_load_entries`)."""
        st.cache.set_step_tokens(0)  # the previous proposal's speculative entries: never committed
        st.last.copy_(self._catch_up(st.cache, st.text, st.lengths, st.hidden, st.num, st.start, st.last))

    def __repr__(self):
        tree = f", tree={self.tree!r}" if self.tree is not None else ""
        vocab = f", draft_vocab={self.draft_vocab.numel()} ids" if self.draft_vocab is not None else ""
        return (f"MTPDrafter({type(self.layers).__name__}, {self.layers.count_field}={self.layers.num_steps}"
                f"{tree}{vocab})")


class _StaticMTP:
    """Buffers of the static MTP path for one shape bucket (kept across ``generate()`` calls so a
    captured graph stays valid): the text, the target hidden states of the entries to catch up on
    (``[B, K + 1, D]``, K the largest the bucket proposes), their counts and the first one's
    index, each row's last catch-up output, and per K proposed its program and output."""

    def __init__(self, key, B, K, width, D, dtype, dev):
        self.key = key
        self.cache = None
        self.programs: dict[int, CapturedProgram] = {}
        self.outs: dict[int, torch.Tensor] = {}
        self.catch_up: CapturedProgram | None = None
        self.pool = None
        self.text = torch.zeros(B, width, dtype=torch.long, device=dev)
        self.lengths = torch.zeros(B, dtype=torch.long, device=dev)
        self.hidden = torch.zeros(B, K + 1, D, dtype=dtype, device=dev)
        self.num = torch.zeros(B, dtype=torch.long, device=dev)
        self.start = torch.zeros((), dtype=torch.long, device=dev)
        self.last = torch.zeros(B, D, dtype=dtype, device=dev)


def _fetch_hub_mtp_files(repo_id: str) -> str:
    """The local snapshot folder of hub checkpoint ``repo_id`` holding its config, its index (or
    single file) and the shards that hold ``mtp.*`` tensors (fetched through ``huggingface_hub``,
    from its cache when present).

    Raises: ValueError when the files cannot be fetched (offline, unknown id)."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError as err:  # pragma: no cover - transformers depends on it
        raise ValueError(f"{repo_id!r} is not a local folder and huggingface_hub is not installed") from err
    try:
        cfg = hf_hub_download(repo_id, "config.json")
        try:
            index = hf_hub_download(repo_id, _INDEX)
        except Exception:  # noqa: BLE001 - a single-file checkpoint
            hf_hub_download(repo_id, _SINGLE)
            return str(Path(cfg).parent)
        weight_map = json.loads(Path(index).read_text())["weight_map"]
        for shard in sorted({f for k, f in weight_map.items() if k.startswith(_PREFIXES)}):
            hf_hub_download(repo_id, shard)
    except Exception as err:  # noqa: BLE001 - network, auth, unknown repository
        raise ValueError(f"drafter='mtp': the model was loaded from {repo_id!r}, which is not a local folder, and its "
                         f"checkpoint files could not be fetched ({type(err).__name__}: {err}); pass the folder "
                         "with MTPDrafter.from_pretrained(path, target=model)") from err
    return str(Path(cfg).parent)
