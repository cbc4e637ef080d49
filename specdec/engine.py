"""The speculative loop: draft -> verify -> accept -> commit, batched with ragged acceptance.

One step (DESIGN.md, "One speculative step"): for each row, the drafter proposes k_i <= K
tokens; the target runs ``[pending, d_1 .. d_k]`` (rows padded to the batch's 1 + max k_i with
placeholders that never reach a committed state) in one forward; acceptance picks n_i and a
correction/bonus token c_i; the cache commits n_i + 1 tokens per row; c_i becomes pending.
"""

from __future__ import annotations

import numbers
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch

from .drafters import Drafter, make_drafter
from .models import adapter_for
from .rollback import RollbackStrategy, make_strategy
from .tree import accept_tree, check_tree_nodes, tree_for, tree_step
from .verify import SamplingConfig, greedy_accept, process_logits, sample_accept

__all__ = ["DECODE_PATHS", "MAX_SPECULATIVE_TOKENS", "SpeculativeGenerator", "Stats"]

MAX_SPECULATIVE_TOKENS = 64
#: ``decode_path=`` values: "auto" = CUDA graphs on CUDA when the call's settings allow the static
#: path, else eager; "eager", "static" (fixed shapes, no graphs; also on CPU) and "cuda_graph" force one
DECODE_PATHS = ("auto", "eager", "static", "cuda_graph")

# generation settings this engine does not implement: (attribute, value meaning "off")
_UNSUPPORTED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "num_return_sequences": 1,
    "penalty_alpha": None,
    "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "force_words_ids": None,
    "constraints": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "min_p": None,
    "top_h": None,
    "diversity_penalty": 0.0,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "remove_invalid_values": False,
    "guidance_scale": None,
    "watermarking_config": None,
    "stop_strings": None,
    "token_healing": False,
    "dola_layers": None,
    "prefill_chunk_size": None,
    "assistant_model": None,
    "prompt_lookup_num_tokens": None,
    "output_attentions": False,
    "output_hidden_states": False,
}
_SUPPORTED_SETTINGS = (
    "max_new_tokens/max_length, min_new_tokens/min_length, do_sample, temperature, top_k, top_p, "
    "repetition_penalty, eos_token_id (int or list), pad_token_id, max_time, return_dict_in_generate, "
    "output_scores, output_logits"
)


def _hf_penalises_padding() -> bool:
    """Whether the installed transformers counts left-padding ids in ``repetition_penalty``: 5.17 does
    (the processor sees the whole padded row); newer releases (5.24) pass the padding lengths as
    ``prompt_ignore_length`` and skip them."""
    import inspect

    from transformers.generation.utils import GenerationMixin

    try:
        return "padding_lengths" not in inspect.getsource(GenerationMixin._get_logits_processor)
    except (OSError, TypeError):
        return True


class _TargetLogitsProcessor:
    """The logits processors of HF ``generate()`` that change the *target's* distribution, applied
    to every verify position with that position's own prefix (so acceptance sees what HF's
    token-by-token decoding sees):

    * ``RepetitionPenaltyLogitsProcessor``: scores of tokens present in the prefix (the padded
      prompt row as HF holds it, the generated tokens, and the step's drafts before the position)
      are divided (positive) or multiplied (negative) by the penalty (left padding counts as
      the installed transformers counts it, see :func:`_hf_penalises_padding`);
    * ``MinLengthLogitsProcessor`` / ``MinNewTokensLengthLogitsProcessor``: EOS scores are -inf
      while the prefix is shorter than ``min_length`` / has fewer than ``min_new_tokens`` new tokens.

    Both are element-wise on the logits, so they commute (HF applies the penalty first).
    """

    def __init__(self, penalty, min_new_tokens, min_length, eos, input_ids, mask, vocab_size):
        self.penalty = penalty
        self.min_new_tokens = int(min_new_tokens or 0)
        self.min_length = int(min_length or 0)
        self.eos = torch.tensor(eos, dtype=torch.long, device=input_ids.device) if eos else None
        self.prompt_width = input_ids.shape[1]
        self.seen = None
        if penalty is not None:
            B = input_ids.shape[0]
            seen = torch.zeros(B, vocab_size + 1, dtype=torch.bool, device=input_ids.device)
            ids = input_ids if _hf_penalises_padding() else input_ids.masked_fill(mask == 0, vocab_size)
            self.seen = seen.scatter_(1, ids, True)[:, :vocab_size].contiguous()

    @staticmethod
    def make(penalty, min_new_tokens, min_length, eos, input_ids, mask, vocab_size):
        eos_rule = bool(eos) and ((min_new_tokens or 0) > 0 or (min_length or 0) > 0)
        if penalty is None and not eos_rule:
            return None
        if not eos_rule:
            min_new_tokens = min_length = 0
        return _TargetLogitsProcessor(penalty, min_new_tokens, min_length, eos, input_ids, mask, vocab_size)

    def add(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Record tokens appended to ``rows`` (for the repetition penalty)."""
        if self.seen is not None:
            self.seen[rows, tokens] = True

    def __call__(self, logits: torch.Tensor, step_tokens: torch.Tensor | None, n_gen: torch.Tensor) -> torch.Tensor:
        """Process ``logits [B, T, V]`` of step positions 0..T-1; fp32 copy.

        ``step_tokens [B, T]``: the step's tokens (the pending one, then the drafts), or None for
        the logits after the prompt (T = 1). ``n_gen [B]``: tokens generated before the step's
        first prediction (the pending token included).
        """
        out = logits.float().clone()
        B, T, V = out.shape
        if self.seen is not None:
            seen = self.seen[:, None, :].expand(B, T, V).clone()
            if step_tokens is not None and T > 1:
                drafts = torch.nn.functional.one_hot(step_tokens[:, 1:T], V).cumsum(1) > 0  # [B, T-1, V]
                seen[:, 1:] |= drafts
            p = self.penalty
            out = torch.where(seen, torch.where(out < 0, out * p, out / p), out)
        if self.eos is not None:
            new = n_gen[:, None] + torch.arange(T, device=out.device)[None, :]  # new tokens before the prediction
            block = (new < self.min_new_tokens) | (self.prompt_width + new < self.min_length)
            eos_cols = torch.zeros(V, dtype=torch.bool, device=out.device)
            eos_cols[self.eos[self.eos < V]] = True
            out = out.masked_fill(block[:, :, None] & eos_cols, float("-inf"))
        return out


@dataclass
class Stats:
    """What one ``generate()`` did. Names as Spec-Bench uses them; times in seconds.

    mean_accepted_tokens: tokens committed per target forward per sequence, including the
        bonus/correction token (plain decoding = 1.00). acceptance_rate: accepted drafts /
        proposed drafts (0 when nothing was proposed). accept_histogram[n]: row-steps that
        accepted n drafts. proposed_tokens / accepted_tokens: drafts verified / accepted over
        all row-steps. steps: target verify forwards. new_tokens: tokens generated
        (all rows, up to and including EOS). draft_s / verify_s / rollback_s: time proposing,
        in the target forward + acceptance, and committing state; prefill_s: the prompt's
        forward and cache setup; wall_s: the whole call.
        decode_path: how the steps ran: ``"eager"`` (dynamic shapes, host-side bookkeeping),
        ``"static"`` (fixed shapes, device-side bookkeeping, one host sync per step) or
        ``"cuda_graph"`` (static, with the verify forward and the commit replayed as CUDA graphs).
    """

    steps: int = 0
    new_tokens: int = 0
    mean_accepted_tokens: float = 0.0
    acceptance_rate: float = 0.0
    accept_histogram: list = field(default_factory=list)
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    rollback_s: float = 0.0
    prefill_s: float = 0.0
    wall_s: float = 0.0
    decode_path: str = "eager"

    def as_dict(self) -> dict:
        return asdict(self)


class _Timer:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def now(self):
        if self.cuda:  # phase times need the device to be done; costs a sync per phase
            torch.cuda.synchronize()
        return time.perf_counter()


class _StepClock:
    """Phase marks without host syncs: CUDA events on CUDA (read once at the end), else perf_counter."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.marks = []

    def mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks.append(ev)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """Durations between consecutive marks, in seconds."""
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def _as_id_list(eos) -> list[int]:
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        eos = eos.flatten().tolist()
    if isinstance(eos, numbers.Integral) and not isinstance(eos, bool):
        return [int(eos)]
    if isinstance(eos, (list, tuple)) and all(isinstance(e, numbers.Integral) and not isinstance(e, bool) for e in eos):
        return [int(e) for e in eos]
    raise ValueError(f"eos_token_id must be an int, a list of ints or None, got {eos!r}")


class SpeculativeGenerator:
    """Exact speculative decoding for a Hugging Face hybrid causal LM (what :func:`specdec.wrap` returns).

    Args:
        model: a loaded HF causal LM of a supported family (see ``specdec.models.supported_families()``).
        drafter: ``"ngram"`` or a :class:`specdec.drafters.Drafter` instance.
        rollback: ``"snapshot"``, ``"ring"``, ``"replay"`` (or ``"replay_deferred"``) or a
            :class:`specdec.rollback.RollbackStrategy`.
        num_speculative_tokens: K, drafts per step, 0..64 (0 = plain decoding through the same
            engine: one token per forward, the drafter is not called).
        decode_path: ``"auto"`` (default: the static path with CUDA graphs on CUDA when the call
            allows it, the eager path otherwise), ``"eager"``, ``"static"`` or ``"cuda_graph"``.
            The static path needs greedy or plain sampling without stopping criteria, repetition
            penalty, min length or returned scores; forcing it with those raises.

    Raises:
        TypeError: model is not a causal LM, drafter/rollback of the wrong type, K not an int.
        ValueError: unsupported family, unknown drafter/strategy name, K out of range, a drafter
            whose vocabulary differs from the target's.
    """

    def __init__(self, model, drafter="ngram", rollback="replay", num_speculative_tokens: int = 4,
                 decode_path: str = "auto"):
        self._static: dict = {}  # shape bucket -> StaticDecoder (the most recent one is kept)
        self.adapter = adapter_for(model)
        self.model = model
        self.num_speculative_tokens = num_speculative_tokens
        self.decode_path = decode_path
        self.drafter = drafter
        self.strategy = rollback
        self.last_stats: Stats | None = None
        self.last_cache = None

    # settings: validated whenever they are set, also after construction ---------------------
    @property
    def num_speculative_tokens(self) -> int:
        """K, drafts per step (0 = plain decoding)."""
        return self._K

    @num_speculative_tokens.setter
    def num_speculative_tokens(self, value):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"num_speculative_tokens must be an int, got {type(value).__name__}")
        if not 0 <= value <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}] (0 = plain decoding), got {value}"
            )
        self._K = int(value)
        self._static.clear()

    @property
    def decode_path(self) -> str:
        """``"auto"``, ``"eager"``, ``"static"`` or ``"cuda_graph"`` (see the class docstring)."""
        return self._decode_path

    @decode_path.setter
    def decode_path(self, value):
        if value not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {value!r}")
        if value == "cuda_graph" and self.adapter.device.type != "cuda":
            raise ValueError(f"decode_path='cuda_graph' needs a CUDA model, this one is on {self.adapter.device}; "
                             "use 'static' or 'eager'")
        self._decode_path = value

    @property
    def drafter(self) -> Drafter:
        """The drafter (``"ngram"`` or a :class:`specdec.drafters.Drafter` may be assigned)."""
        return self._drafter

    @drafter.setter
    def drafter(self, value):
        d = make_drafter(value)
        dv = d.vocab_size
        if dv is not None and dv != self.adapter.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({dv} tokens) differs from the target's ({self.adapter.vocab_size}); "
                "speculative decoding needs the same tokenizer and vocabulary"
            )
        self._drafter = d

    @property
    def strategy(self) -> RollbackStrategy:
        """The rollback strategy (a name from ``specdec.rollback.STRATEGIES`` or an instance may be assigned)."""
        return self._strategy

    @strategy.setter
    def strategy(self, value):
        self._strategy = make_strategy(value)
        self._static.clear()

    # ------------------------------------------------------------------------------------
    def _resolve(self, input_ids, attention_mask, generation_config, overrides: dict):
        from transformers import GenerationConfig

        if isinstance(input_ids, list):
            raise TypeError("input_ids must be a torch.LongTensor [batch, length], got a list; use torch.tensor(...)")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.LongTensor [batch, length], got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [batch, length], got shape {tuple(input_ids.shape)}")
        if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids is empty (shape {tuple(input_ids.shape)}); give at least one prompt token")
        V = self.adapter.vocab_size
        if bool(((input_ids < 0) | (input_ids >= V)).any()):
            raise ValueError(f"input_ids holds ids outside the vocabulary [0, {V})")
        input_ids = input_ids.to(device=self.adapter.device, dtype=torch.long)

        if generation_config is None:
            base = getattr(self.model, "generation_config", None)
            gc = GenerationConfig.from_dict(base.to_dict()) if base is not None else GenerationConfig()
        elif isinstance(generation_config, GenerationConfig):
            gc = GenerationConfig.from_dict(generation_config.to_dict())
        else:
            raise TypeError(f"generation_config must be a transformers.GenerationConfig, got {type(generation_config).__name__}")
        for key, val in overrides.items():
            if val is not None:
                setattr(gc, key, val)
        for key, off in _UNSUPPORTED.items():
            val = getattr(gc, key, off)
            if val is not None and val != off and not (off is None and val in (0, 1.0, [], False)):
                raise ValueError(
                    f"unsupported generation setting {key}={val!r}: specdec's generate() supports "
                    + _SUPPORTED_SETTINGS
                )

        if getattr(gc, "use_cache", True) is False:  # HF decodes without a cache then: same tokens, slower
            warnings.warn("use_cache=False has no effect: specdec always decodes with its own cache (same output)",
                          UserWarning, stacklevel=3)
        eos = _as_id_list(gc.eos_token_id)
        pad = gc.pad_token_id
        if isinstance(pad, torch.Tensor) and pad.numel() == 1:
            pad = pad.item()
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, numbers.Integral)):
            raise ValueError(f"pad_token_id must be an int token id or None, got {pad!r}")
        if attention_mask is None:
            if pad is not None and pad not in eos and bool((input_ids == pad).any()):
                attention_mask = (input_ids != pad).long()
            else:
                attention_mask = torch.ones_like(input_ids)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must be a tensor of the same shape as input_ids {tuple(input_ids.shape)}, got {got}")
        mask = attention_mask.to(device=input_ids.device)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("attention_mask must hold only 0 (padding) and 1 (token)")
        mask = mask.long()
        if bool((mask.sum(1) == 0).any()):
            row = int((mask.sum(1) == 0).nonzero()[0, 0])
            raise ValueError(f"row {row} of the batch is all padding; every row needs at least one prompt token")
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError("attention_mask must be left-padded (zeros then ones in each row), as HF generate() expects for decoder-only models")

        max_new = gc.max_new_tokens
        if max_new is None and gc.max_length is not None:
            if gc.max_length < input_ids.shape[1]:
                raise ValueError(
                    f"max_length={gc.max_length} is shorter than the prompt ({input_ids.shape[1]} tokens); "
                    "set max_new_tokens instead"
                )
            max_new = gc.max_length - input_ids.shape[1]
        elif max_new is None:  # as HF: with no length set anywhere, 20 new tokens
            max_pos = getattr(self.model.config, "max_position_embeddings", None)
            max_new = 20 if max_pos is None else max(0, min(20, max_pos - input_ids.shape[1]))
        if isinstance(max_new, bool) or not isinstance(max_new, int):
            raise TypeError(f"max_new_tokens must be an int, got {type(max_new).__name__}")
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new}")

        sampling = None
        if gc.do_sample:
            top_k = gc.top_k if gc.top_k else None
            sampling = SamplingConfig(
                temperature=gc.temperature if gc.temperature is not None else 1.0, top_k=top_k, top_p=gc.top_p
            )
        else:
            if gc.temperature is not None and gc.temperature != 1.0:
                # as HF: sampling settings have no effect on greedy decoding; say so rather than fail
                warnings.warn(f"temperature={gc.temperature!r} has no effect with do_sample=False (greedy)", UserWarning,
                              stacklevel=3)
        if pad is None:
            pad = eos[0] if eos else 0
        opts = self._resolve_outputs(gc, input_ids, mask, eos)
        return input_ids, mask, max_new, sampling, eos, int(pad), opts

    def _resolve_outputs(self, gc, input_ids, mask, eos) -> dict:
        """Logits processing (repetition penalty, min length) and output options of ``gc``."""
        def count(name):
            val = getattr(gc, name, None)
            if val is None:
                return 0
            if isinstance(val, bool) or not isinstance(val, int) or val < 0:
                raise ValueError(f"{name} must be an int >= 0, got {val!r}")
            return val

        min_new, min_len = count("min_new_tokens"), count("min_length")
        penalty = gc.repetition_penalty
        if penalty is not None:
            if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not penalty > 0:
                raise ValueError(f"repetition_penalty must be a number > 0, got {penalty!r}")
            penalty = None if float(penalty) == 1.0 else float(penalty)
        max_time = gc.max_time
        if max_time is not None and (isinstance(max_time, bool) or not isinstance(max_time, (int, float)) or max_time <= 0):
            raise ValueError(f"max_time must be a number of seconds > 0, got {max_time!r}")
        return {
            "processor": _TargetLogitsProcessor.make(
                penalty, min_new, min_len, eos, input_ids, mask, self.adapter.vocab_size
            ),
            "return_dict": bool(gc.return_dict_in_generate),
            "output_scores": bool(gc.output_scores) and bool(gc.return_dict_in_generate),
            "output_logits": bool(gc.output_logits) and bool(gc.return_dict_in_generate),
            "max_time": max_time,
        }

    def _check_drafts(self, drafts, counts, B, K):
        if not isinstance(drafts, torch.Tensor) or not isinstance(counts, torch.Tensor):
            raise TypeError("Drafter.propose must return (draft_tokens LongTensor [B, K], num_draft_tokens LongTensor [B])")
        if drafts.dim() != 2 or drafts.shape[0] != B:
            raise ValueError(f"drafter returned draft_tokens of shape {tuple(drafts.shape)}; expected [{B}, {K}]")
        if drafts.shape[1] > K:
            raise ValueError(f"drafter returned {drafts.shape[1]} draft tokens per row; at most num_speculative_tokens={K}")
        if counts.shape != (B,):
            raise ValueError(f"drafter returned num_draft_tokens of shape {tuple(counts.shape)}; expected [{B}]")
        if bool(((counts < 0) | (counts > drafts.shape[1])).any()):
            raise ValueError(f"drafter returned num_draft_tokens outside [0, {drafts.shape[1]}]: {counts.tolist()}")
        used = torch.arange(drafts.shape[1], device=drafts.device)[None, :] < counts[:, None].to(drafts.device)
        V = self.adapter.vocab_size
        if bool((((drafts < 0) | (drafts >= V)) & used).any()):
            raise ValueError(f"drafter proposed token ids outside the target's vocabulary [0, {V})")

    def _pick_first(self, logits, sampling, generator):
        if sampling is None:
            return logits.argmax(-1)
        return torch.multinomial(process_logits(logits, sampling), 1, generator=generator)[:, 0]

    # ------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id=None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        generation_config=None,
        streamer=None,
        stopping_criteria=None,
        max_length: int | None = None,
        **kwargs,
    ):
        """Generate with speculative decoding; the output is laid out as HF ``generate()`` lays it out.

        Args:
            input_ids: ``[B, L]`` int64 left-padded prompts (moved to the model's device if elsewhere).
            attention_mask: ``[B, L]`` 0/1 (default: inferred from ``pad_token_id`` as HF does, else ones).
            max_new_tokens: new tokens per row (default from the generation config).
            do_sample, temperature, top_k, top_p: sampling (lossless rejection sampling) or greedy.
            eos_token_id: int or list of ints; pad_token_id: fills rows that stopped early.
            generator: ``torch.Generator`` for reproducible sampling.
            generation_config: a ``transformers.GenerationConfig`` (explicit arguments override it).
            streamer: an HF streamer (batch 1): as in HF, first the prompt, then the committed tokens
                in order, then ``end()``.
            stopping_criteria: an HF ``StoppingCriteriaList`` (or a list of criteria), checked after
                every committed token on that row's own sequence (prompt row + its new tokens).
            **kwargs: further ``GenerationConfig`` fields, as HF's ``generate()`` takes them:
                ``min_new_tokens``, ``min_length``, ``repetition_penalty``, ``max_time``,
                ``return_dict_in_generate``, ``output_scores``, ``output_logits``; any other setting that
                changes decoding raises ``ValueError``.

        Returns:
            ``[B, L + G]`` int64: prompts as given, then G = the longest row's new tokens; rows that
            stopped early are padded with ``pad_token_id``. With ``return_dict_in_generate=True`` a
            ``transformers.generation.GenerateDecoderOnlyOutput`` with ``sequences`` (that tensor) and,
            when asked, ``scores`` / ``logits`` (tuples of G ``[B, V]`` fp32 tensors: the processed
            and the raw target scores of each new token; positions after a row stopped hold zeros).
            Stats of the call in ``self.last_stats``.

        Raises:
            TypeError / ValueError: bad arguments (checked before any work), unsupported settings.
        """
        from transformers import GenerationConfig

        config_fields = set(GenerationConfig().to_dict())
        unknown = sorted(k for k in kwargs if k not in config_fields or k.startswith("_"))
        if unknown:
            raise ValueError(
                f"unsupported generate() argument(s): {unknown}; supported: input_ids, attention_mask, "
                "max_new_tokens, max_length, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, "
                "generator, generation_config, streamer, stopping_criteria, and the GenerationConfig settings "
                + _SUPPORTED_SETTINGS
            )
        overrides = dict(
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, max_length=max_length, **kwargs,
        )
        input_ids, mask, max_new, sampling, eos, pad, opts = self._resolve(
            input_ids, attention_mask, generation_config, overrides
        )
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError("streamer= supports batch size 1 only, as in HF generate()")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        stopping_criteria = self._stopping_criteria(stopping_criteria, opts["max_time"])
        return self._run(input_ids, mask, max_new, sampling, eos, pad, generator, streamer, stopping_criteria, opts)

    @staticmethod
    def _stopping_criteria(criteria, max_time):
        from transformers import StoppingCriteriaList
        from transformers.generation.stopping_criteria import MaxTimeCriteria

        if criteria is None:
            out = StoppingCriteriaList()
        elif isinstance(criteria, StoppingCriteriaList) or (
            isinstance(criteria, (list, tuple)) and all(callable(c) for c in criteria)
        ):
            out = StoppingCriteriaList(list(criteria))
        elif callable(criteria):
            out = StoppingCriteriaList([criteria])
        else:
            raise TypeError(
                f"stopping_criteria must be a transformers.StoppingCriteriaList (or a list of criteria), "
                f"got {type(criteria).__name__}"
            )
        if max_time is not None:
            out.append(MaxTimeCriteria(max_time=max_time))
        return out if len(out) else None

    def _run(self, input_ids, mask, max_new, sampling, eos, pad, generator, streamer, stopping_criteria, opts=None):
        ad = self.adapter
        dev = input_ids.device
        B, Lp = input_ids.shape
        K = self.num_speculative_tokens
        T_max = K + 1
        stats = Stats(accept_histogram=[0] * (K + 1))
        timer = _Timer(dev)
        t_start = timer.now()
        if max_new == 0:
            self.last_stats = stats
            if streamer is not None:
                streamer.put(input_ids.cpu())
                streamer.end()
            return self._output(input_ids.clone(), opts, None, None, 0)
        path = self._pick_path(dev, streamer, stopping_criteria, opts)
        if streamer is not None:  # after every check: HF streams the prompt first
            streamer.put(input_ids.cpu())  # (TextStreamer(skip_prompt=True) drops it)
        if path != "eager":
            return self._run_static(input_ids, mask, max_new, sampling, eos, pad, generator, opts,
                                    cuda_graphs=path == "cuda_graph", streamer=streamer)

        drafter = self.drafter if K > 0 else None  # K = 0: plain decoding, the drafter is not used
        tree = tree_for(drafter, K)  # a draft tree (Medusa): its nodes run in one forward (specdec/tree.py)
        if tree is not None:
            T_max = max(T_max, tree.num_nodes)
        cache = ad.new_cache(B, Lp + max_new + 2 * T_max, T_max, self._step_strategy())
        self.last_cache = cache
        logits, hidden = ad.prefill(input_ids, mask, cache)
        if drafter is not None and drafter.wants_hidden_states:  # e.g. Medusa heads: the target's last hidden state
            drafter.observe(hidden)
        # HF logits processors that change the target's distribution (repetition penalty, min
        # length), applied to every position with its own prefix; None when none is active
        proc = opts["processor"] if opts else None
        raw_first = logits.float()
        logits = proc(raw_first[:, None], None, torch.zeros(B, dtype=torch.long, device=dev))[:, 0] if proc else raw_first
        first = self._pick_first(logits, sampling, generator)
        stats.prefill_s = timer.now() - t_start

        prompt_len = mask.sum(1)
        pads = Lp - prompt_len
        width = Lp + max_new + T_max
        text = torch.zeros(B, width, dtype=torch.long, device=dev)
        cols = torch.arange(Lp, device=dev)[None, :]
        src = (cols + pads[:, None]).clamp(max=Lp - 1)
        text[:, :Lp] = torch.where(cols < prompt_len[:, None], input_ids.gather(1, src), torch.zeros_like(cols))
        lengths = prompt_len.clone()
        n_gen = torch.zeros(B, dtype=torch.long, device=dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        eos_t = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        rows = torch.arange(B, device=dev)
        # output_scores / output_logits: per row and new-token position, the scores it was chosen from
        V = logits.shape[-1]
        score_buf = torch.zeros(B, max_new, V, device=dev) if opts and opts["output_scores"] else None
        logit_buf = torch.zeros(B, max_new, V, device=dev) if opts and opts["output_logits"] else None

        def warped(scores):  # HF's returned scores include the sampling warpers
            if sampling is None or score_buf is None:
                return scores
            flat = scores.reshape(-1, V)
            for w in sampling.warpers():
                flat = w(None, flat)
            return flat.reshape(scores.shape)

        # HF pads a row stopped by stopping_criteria only when it has an EOS criterion; without one the
        # row runs on until every row has stopped, and all rows end at that step (crit_step: the new-token
        # count at which each row's criteria first held; max_new + 1 = not yet)
        run_on = stopping_criteria is not None and eos_t is None
        crit_step = torch.full((B,), max_new + 1, dtype=torch.long, device=dev)

        def emit(new_tokens: torch.Tensor, counts: torch.Tensor, scores=None, raw=None) -> torch.Tensor:
            """Append up to counts[b] tokens per row, stopping rows at EOS / budget / criteria.

            ``scores`` / ``raw`` ``[B, >= T, V]``: processed / raw scores token j was chosen from.
            Returns how many tokens each row took."""
            nonlocal finished
            before = n_gen.clone()
            for j in range(new_tokens.shape[1]):
                live = (~finished) & (j < counts)
                if not bool(live.any()):
                    break
                tok = new_tokens[:, j]
                text[rows[live], lengths[live]] = tok[live]
                if proc is not None:
                    proc.add(rows[live], tok[live])
                if score_buf is not None:
                    score_buf[rows[live], n_gen[live]] = scores[live, j]
                if logit_buf is not None:
                    logit_buf[rows[live], n_gen[live]] = raw[live, j].float()
                lengths[live] += 1
                n_gen[live] += 1
                if streamer is not None and bool(live[0]):
                    streamer.put(tok[:1].cpu())
                done = n_gen >= max_new
                if eos_t is not None:
                    done |= torch.isin(tok, eos_t)
                if stopping_criteria is not None:
                    hit = self._criteria_per_row(stopping_criteria, input_ids, text, prompt_len, n_gen, live)
                    if run_on:
                        crit_step[hit & (crit_step > max_new)] = n_gen[hit & (crit_step > max_new)]
                        if bool((crit_step <= max_new).all()):
                            done |= n_gen >= crit_step.max()
                    else:
                        done |= hit
                finished = finished | (live & done)
            return n_gen - before

        emit(first[:, None], torch.ones(B, dtype=torch.long, device=dev), warped(logits[:, None]), raw_first[:, None])
        if drafter is not None:
            drafter.set_decode_path("eager")
            drafter.start(
                target_vocab_size=ad.vocab_size, batch_size=B, device=dev, sampling=sampling,
                generator=generator, max_length=Lp + max_new + T_max,
            )
        row_steps = committed = 0
        grown = Lp + 1  # host-side bound on every row's text length (grows by <= K + 1 a step)
        while not bool(finished.all()):
            bound, grown = min(width, grown), grown + K + 1
            if tree is not None:  # draft tree -> one tree forward -> longest accepted path -> commit
                rs, cm = tree_step(ad, drafter, cache, tree, text=text, lengths=lengths, n_gen=n_gen, finished=finished,
                                   max_new=max_new, sampling=sampling, generator=generator, proc=proc, emit=emit,
                                   warped=warped, timer=timer, stats=stats)
                row_steps += rs
                committed += cm
                continue
            t0 = timer.now()
            if drafter is not None:
                drafts, counts = self._propose(drafter, text, lengths, K, bound)
                self._check_drafts(drafts, counts, B, K)
            else:
                drafts = torch.zeros(B, 0, dtype=torch.long, device=dev)
                counts = torch.zeros(B, dtype=torch.long, device=dev)
            t1 = timer.now()
            drafts = drafts.to(dev).long()
            k = torch.minimum(counts.to(dev).long(), (max_new - n_gen - 1).clamp(min=0))
            k = k.masked_fill(finished, 0)
            T = 1 + int(k.max())
            used = torch.arange(T - 1, device=dev)[None, :] < k[:, None]
            step_drafts = torch.where(used, drafts[:, : T - 1], torch.zeros_like(drafts[:, : T - 1]))
            pending = text[rows, lengths - 1]
            step = torch.cat([pending[:, None], step_drafts], dim=1)
            logits, hidden = ad.forward(step, cache)
            raw = logits
            if proc is not None:
                logits = proc(logits, step, n_gen)
            if sampling is None:
                n, c = greedy_accept(logits, step_drafts, k)
            else:
                probs = drafter.draft_probs() if drafter is not None else None
                n, c = sample_accept(logits, step_drafts, k, sampling, probs, generator)
            active = ~finished
            new = torch.cat([step_drafts, torch.zeros_like(c)[:, None]], dim=1)
            new[rows, n] = c
            taken = emit(new, n + 1, warped(logits), raw)
            t2 = timer.now()
            # commit [pending, d_1 .. d_n] -- or fewer when EOS / the budget cut the row short, so the
            # cache always covers the row's text minus its last token
            cache.commit(torch.minimum(taken, n + 1))
            if drafter is not None and drafter.wants_hidden_states:  # hidden state of the token whose logits gave c
                drafter.observe(hidden[rows, n])
            t3 = timer.now()
            # stats over rows that took part in this step
            stats.steps += 1
            na = n[active]
            row_steps += int(active.sum())
            committed += int((na + 1).sum())
            stats.proposed_tokens += int(k[active].sum())
            stats.accepted_tokens += int(na.sum())
            for v in na.tolist():
                stats.accept_histogram[v] += 1
            stats.draft_s += t1 - t0
            stats.verify_s += t2 - t1
            stats.rollback_s += t3 - t2
        if streamer is not None:
            streamer.end()
        if run_on and bool((crit_step <= max_new).all()):
            n_gen = n_gen.clamp(max=int(crit_step.max()))  # rows that ran ahead end where HF's batch stopped
        out = torch.cat([input_ids, self._generated(text, prompt_len, n_gen, pad)], dim=1)
        stats.new_tokens = int(n_gen.sum())
        stats.mean_accepted_tokens = committed / row_steps if row_steps else 0.0
        stats.acceptance_rate = stats.accepted_tokens / stats.proposed_tokens if stats.proposed_tokens else 0.0
        stats.wall_s = timer.now() - t_start
        self.last_stats = stats
        return self._output(out, opts, score_buf, logit_buf, out.shape[1] - Lp)

    def _pick_path(self, dev, streamer, stopping_criteria, opts) -> str:
        """``"eager"``, ``"static"`` or ``"cuda_graph"`` for this call (see ``decode_path``)."""
        blockers = []
        if stopping_criteria is not None:
            blockers.append("stopping_criteria / max_time")
        if opts and opts["processor"] is not None:
            blockers.append("repetition_penalty / min_new_tokens / min_length")
        if opts and (opts["output_scores"] or opts["output_logits"]):
            blockers.append("output_scores / output_logits")
        want = self.decode_path
        if want == "auto":
            return "eager" if blockers or dev.type != "cuda" else "cuda_graph"
        if want != "eager" and blockers:
            raise ValueError(f"decode_path={want!r} does not support {', '.join(blockers)}; use decode_path='eager' "
                             "or 'auto' (which picks the eager path for such calls)")
        if want == "cuda_graph" and dev.type != "cuda":
            raise ValueError(f"decode_path='cuda_graph' needs a CUDA model, this one is on {dev}; use 'static' or 'eager'")
        return want

    def _static_decoder(self, B, T, max_len, cuda_graphs, tree=None):
        from .static import StaticDecoder

        key = (B, T, max_len, cuda_graphs, tree)
        dec = self._static.get(key)
        if dec is None:
            self._static.clear()  # one bucket at a time: its buffers can be large
            dec = self._static[key] = StaticDecoder(self.adapter, self._step_strategy(), B, T, max_len, cuda_graphs,
                                                    tree=tree)
        return dec

    def _step_strategy(self):
        """The rollback strategy of the target's cache: the chosen one, or for plain decoding
        (K = 0, nothing to roll back) the in-place update, which moves the state once in and
        once out per step instead of three times."""
        if self.num_speculative_tokens == 0:
            from .rollback import InPlaceUpdate

            return InPlaceUpdate()
        return self.strategy

    def _run_static(self, input_ids, mask, max_new, sampling, eos, pad, generator, opts, cuda_graphs, streamer=None):
        """The decode loop with fixed shapes: every step runs T = K + 1 tokens per row (rows with
        fewer drafts carry placeholders that never reach a committed state), acceptance, EOS and
        budget handling, the text buffer and the stats stay on the device; the only host sync per
        step is the check whether every row has finished (merged with the drafter-output checks).
        A tree drafter's step runs the tree's N nodes (:func:`specdec.tree.accept_tree` picks the
        path, the bucket commits it), so a step commits up to depth + 1 tokens. A streamer (batch 1)
        gets each step's committed tokens, one put per token as on the eager path, from the step's
        one host sync (no extra sync)."""
        from .static import bucket_length

        ad = self.adapter
        dev = input_ids.device
        B, Lp = input_ids.shape
        K = self.num_speculative_tokens
        V = ad.vocab_size
        drafter = self.drafter if K > 0 else None
        tree = tree_for(drafter, K)  # a draft tree (Medusa): its N nodes run in one forward
        T = tree.num_nodes if tree is not None else K + 1  # tokens per verify forward
        W = tree.max_depth + 1 if tree is not None else K + 1  # tokens a step can commit
        clock = _StepClock(dev)
        clock.mark()
        dec = self._static_decoder(B, T, bucket_length(Lp + max_new + 2 * T), cuda_graphs, tree)
        fresh = dec.new_cache()
        logits, hidden = ad.prefill(input_ids, mask, fresh)
        dec.load(fresh)
        del fresh
        cache = dec.cache
        self.last_cache = cache
        if drafter is not None and drafter.wants_hidden_states:
            drafter.observe(hidden)
        first = self._pick_first(logits.float(), sampling, generator)
        if streamer is not None:
            streamer.put(first[:1].cpu())

        prompt_len = mask.sum(1)
        pads = Lp - prompt_len
        width = Lp + max_new + T
        text = torch.zeros(B, width, dtype=torch.long, device=dev)
        cols = torch.arange(Lp, device=dev)[None, :]
        src = (cols + pads[:, None]).clamp(max=Lp - 1)
        text[:, :Lp] = torch.where(cols < prompt_len[:, None], input_ids.gather(1, src), torch.zeros_like(cols))
        rows = torch.arange(B, device=dev)
        text[rows, prompt_len] = first
        lengths = prompt_len + 1
        n_gen = torch.ones(B, dtype=torch.long, device=dev)
        eos_t = torch.tensor(eos, dtype=torch.long, device=dev) if eos else None
        finished = n_gen >= max_new
        if eos_t is not None:
            finished |= torch.isin(first, eos_t)
        if drafter is not None:
            drafter.set_decode_path(dec.path)
            drafter.start(target_vocab_size=V, batch_size=B, device=dev, sampling=sampling, generator=generator,
                          max_length=width)
        j_t = torch.arange(W, device=dev)[None, :]
        j_k = torch.arange(K, device=dev)[None, :]
        hist = torch.zeros(K + 1, dtype=torch.long, device=dev)  # as the eager loop's, also when a tree is shallower
        totals = torch.zeros(3, dtype=torch.long, device=dev)  # row-steps, proposed, accepted
        bad = torch.zeros(2, dtype=torch.bool, device=dev)  # drafter returned bad counts / token ids
        steps = 0
        clock.mark()  # prefill done
        prefill_mark = len(clock.marks) - 1
        done = bool(finished.all())
        grown = Lp + 1  # host-side bound on every row's text length (grows by <= T a step)
        while not done:
            active = ~finished
            clock.mark()
            bound, grown = min(width, grown), grown + W
            path = None
            if tree is not None:
                nodes = self._propose_tree(drafter, text, lengths, tree, bound).to(dev).long()
                bad[1] |= ((nodes < 0) | (nodes >= V)).any()
                k = (max_new - n_gen - 1).clamp(0, tree.max_depth).masked_fill(finished, 0)  # depth limit
                step_drafts = nodes.clamp(0, V - 1)
            elif drafter is not None:
                drafts, counts = self._propose(drafter, text, lengths, K, bound)
                self._check_draft_shapes(drafts, counts, B, K)
                drafts, counts = drafts.to(dev).long(), counts.to(dev).long()
                w = drafts.shape[1]
                if w < K:
                    drafts = torch.cat([drafts, drafts.new_zeros(B, K - w)], dim=1)
                bad[0] |= ((counts < 0) | (counts > w)).any()
                k = torch.minimum(counts.clamp(0, w), (max_new - n_gen - 1).clamp(min=0)).masked_fill(finished, 0)
                used = j_k < k[:, None]
                bad[1] |= (((drafts < 0) | (drafts >= V)) & used).any()
                step_drafts = torch.where(used, drafts.clamp(0, V - 1), torch.zeros_like(drafts))
            else:
                k = torch.zeros(B, dtype=torch.long, device=dev)
                step_drafts = torch.zeros(B, 0, dtype=torch.long, device=dev)
            clock.mark()
            pending = text.gather(1, (lengths - 1)[:, None])
            tokens = torch.cat([pending, step_drafts], dim=1)
            logits, hidden = dec.forward(tokens)
            if tree is not None:
                best, n, c = accept_tree(logits, tokens, tree, k, sampling, generator,
                                         getattr(drafter, "acceptance", "exact"),
                                         getattr(drafter, "posterior_threshold", 0.09),
                                         getattr(drafter, "posterior_alpha", 0.3))
                path = torch.where(j_t <= n[:, None], tree.tensors(dev)["path_of"][best], j_t)
                chain = tokens.gather(1, path)[:, 1:]  # the accepted path's node tokens
                seen = best  # the node whose hidden state gave c
            else:
                if sampling is None:
                    n, c = greedy_accept(logits, step_drafts, k)
                else:
                    probs = drafter.draft_probs() if drafter is not None else None
                    n, c = sample_accept(logits, step_drafts, k, sampling, probs, generator)
                chain, seen = step_drafts, n
            new = torch.cat([chain, c[:, None]], dim=1).scatter(1, n[:, None], c[:, None])
            take = n + 1
            hit_eos = torch.zeros_like(finished)
            if eos_t is not None:
                is_eos = torch.isin(new, eos_t) & (j_t <= n[:, None])
                first_eos = (is_eos.long().cumsum(1) == 0).sum(1)  # index of the first EOS (T if none)
                take = torch.minimum(take, first_eos + 1)
            take = torch.minimum(take, max_new - n_gen).masked_fill(finished, 0)
            if eos_t is not None:
                hit_eos = first_eos < take
            text.scatter_(1, lengths[:, None] + j_t, new)  # columns past lengths + take are scratch
            lengths += take
            n_gen += take
            finished = finished | hit_eos | (n_gen >= max_new)
            clock.mark()
            dec.commit(take, path)  # take <= n + 1: the accepted prefix, cut at EOS / the budget
            if drafter is not None and drafter.wants_hidden_states:
                drafter.observe(hidden[rows, seen])
            clock.mark()
            a = active.long()
            hist.index_add_(0, n, a)
            totals += torch.stack([a.sum(), (k * a).sum(), (n * a).sum()])
            steps += 1
            if streamer is None:
                flags = torch.cat([finished.all()[None], bad]).tolist()  # the step's one host sync
            else:  # the same sync also brings row 0's committed tokens
                flags = torch.cat([finished.all()[None].long(), bad.long(), take[:1], new[0]]).tolist()
            if flags[1] or flags[2]:
                what = (f"num_draft_tokens outside [0, {w}]: {counts.tolist()}" if flags[1] else
                        f"token ids outside the target's vocabulary [0, {V})")
                raise ValueError(f"drafter returned {what}")
            if streamer is not None:
                for tok in flags[4:4 + flags[3]]:
                    streamer.put(torch.tensor([tok]))
            done = bool(flags[0])
        if streamer is not None:
            streamer.end()
        times = clock.seconds()
        stats = Stats(accept_histogram=hist.tolist(), decode_path=dec.path)
        row_steps, proposed, accepted = totals.tolist()
        stats.steps = steps
        stats.proposed_tokens, stats.accepted_tokens = proposed, accepted
        stats.new_tokens = int(n_gen.sum())
        stats.mean_accepted_tokens = (accepted + row_steps) / row_steps if row_steps else 0.0
        stats.acceptance_rate = accepted / proposed if proposed else 0.0
        stats.prefill_s = times[prefill_mark - 1]
        phase = times[prefill_mark + 1:]  # per step: draft, verify + accept, commit, bookkeeping
        stats.draft_s = sum(phase[0::4])
        stats.verify_s = sum(phase[1::4])
        stats.rollback_s = sum(phase[2::4])
        stats.wall_s = sum(times)
        self.last_stats = stats
        out = torch.cat([input_ids, self._generated(text, prompt_len, n_gen, pad)], dim=1)
        return self._output(out, opts, None, None, out.shape[1] - Lp)

    @staticmethod
    def _propose_tree(drafter, text, lengths, spec, bound):
        """``drafter.propose_tree`` on copies of the engine's buffers (as :meth:`_propose`), checked
        by :func:`specdec.tree.check_tree_nodes` (host-side only: no device sync)."""
        return check_tree_nodes(drafter.propose_tree(text[:, :bound].clone(), lengths.clone(), spec), text.shape[0],
                                spec)

    @staticmethod
    def _propose(drafter, text, lengths, K, bound):
        """``drafter.propose`` on copies of the engine's buffers (a drafter that writes into its
        arguments cannot corrupt the text), cut to ``bound`` columns (a host-side bound on every
        row's length: a drafter that scans the text, like n-gram lookup, scans what exists, not
        the whole ``prompt + max_new_tokens`` buffer); its result must be a pair of integer tensors."""
        out = drafter.propose(text[:, :bound].clone(), lengths.clone(), K)
        if not (isinstance(out, (tuple, list)) and len(out) == 2):
            raise TypeError("Drafter.propose must return a pair (draft_tokens LongTensor [B, K], num_draft_tokens "
                            f"LongTensor [B]), got {type(out).__name__}")
        drafts, counts = out
        for name, t in (("draft_tokens", drafts), ("num_draft_tokens", counts)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"Drafter.propose returned {name} of type {type(t).__name__}; expected an integer tensor")
            if t.dtype == torch.bool or t.dtype.is_floating_point or t.dtype.is_complex:
                raise TypeError(f"Drafter.propose returned {name} of dtype {t.dtype}; expected an integer dtype (int64)")
        return drafts, counts

    def _check_draft_shapes(self, drafts, counts, B, K):
        """The host-side part of :meth:`_check_drafts` (types and shapes; no device sync)."""
        if not isinstance(drafts, torch.Tensor) or not isinstance(counts, torch.Tensor):
            raise TypeError("Drafter.propose must return (draft_tokens LongTensor [B, K], num_draft_tokens LongTensor [B])")
        if drafts.dim() != 2 or drafts.shape[0] != B:
            raise ValueError(f"drafter returned draft_tokens of shape {tuple(drafts.shape)}; expected [{B}, {K}]")
        if drafts.shape[1] > K:
            raise ValueError(f"drafter returned {drafts.shape[1]} draft tokens per row; at most num_speculative_tokens={K}")
        if counts.shape != (B,):
            raise ValueError(f"drafter returned num_draft_tokens of shape {tuple(counts.shape)}; expected [{B}]")

    @staticmethod
    def _output(sequences, opts, score_buf, logit_buf, G):
        """The tensor, or HF's ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate``."""
        if not opts or not opts["return_dict"]:
            return sequences
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        def steps(buf):
            return None if buf is None else tuple(buf[:, i] for i in range(G))

        return GenerateDecoderOnlyOutput(sequences=sequences, scores=steps(score_buf), logits=steps(logit_buf))

    @staticmethod
    def _criteria_per_row(criteria, input_ids, text, prompt_len, n_gen, live):
        """Stopping criteria on each live row's own sequence (its prompt row as given, then its new
        tokens): HF checks them in lockstep on ``[B, L + s]``; here rows have their own lengths, so
        rows are checked in groups of equal length."""
        done = torch.zeros_like(live)
        for s in n_gen[live].unique().tolist():
            grp = (live & (n_gen == s)).nonzero()[:, 0]
            idx = prompt_len[grp, None] + torch.arange(s, device=text.device)[None, :]
            seqs = torch.cat([input_ids[grp], text[grp[:, None], idx]], dim=1)
            done[grp] = torch.as_tensor(criteria(seqs, None), device=done.device).bool().reshape(-1)
        return done

    @staticmethod
    def _generated(text, prompt_len, n_gen, pad):
        G = int(n_gen.max())
        cols = torch.arange(G, device=text.device)[None, :]
        src = (prompt_len[:, None] + cols).clamp(max=text.shape[1] - 1)
        gen = text.gather(1, src)
        return torch.where(cols < n_gen[:, None], gen, torch.full_like(gen, pad))

    def __repr__(self):
        return (
            f"SpeculativeGenerator({type(self.model).__name__}, drafter={self.drafter!r}, "
            f"rollback={self.strategy.name!r}, num_speculative_tokens={self.num_speculative_tokens})"
        )
