"""The contracts between ops, their fused kernels and the rollback strategies.

* :class:`SSMOp`: one recurrence (Mamba-2, GDN, KDA) with its fp32 torch reference
  (``verify`` / ``fold`` / ``tree_verify``) and, on the Triton backend, ``kernels``: an object
  satisfying :class:`RollbackKernels`, the fused per-strategy kernels the rollback strategies
  (:mod:`specdec.rollback`) call instead of composing ``verify`` and ``fold``.
* :class:`Conv1dKernels`: the fused causal conv that :class:`specdec.kernels.conv1d.Conv1dOp`
  calls on the Triton backend.
* :class:`LaunchConfig`: launch settings a kernel set uses instead of its hand-picked defaults
  (tests and tuning sweeps only).

Conventions of every kernel call: states fp32, updated in place, no host synchronisation, no
allocation of state-sized buffers (CUDA-graph safe). ``inputs`` / ``params`` are the op's dicts
(``[B, t, ...]`` per step token, as the op's ``verify`` takes them). ``offset`` = step tokens run
by earlier calls of the same step (a Python int). ``state_indices``: ``[B]`` int32/int64, row b
uses state slot ``state_indices[b]``, a negative id is a padding row the call skips (its state
and outputs untouched); None = row b uses slot b (:mod:`specdec.kernels.slots`). Every store
tensor (``live``, ``buf``, ``ring``, ``head``, ``ckpt``, ``hist``, ``hist_len``) has one entry
per slot; inputs, outputs and ``num_tokens`` one per row. ``out``: an optional contiguous output
tensor the call writes (e.g. a CUDA-graph static buffer); padding rows' entries stay unwritten.
``parents`` (tree steps, :mod:`specdec.tree`): a tuple, ``parents[j] < j``, ``-1`` = the committed
state; only with ``offset = 0`` (a tree step is the step's only forward): token j starts from
token ``parents[j]``'s state and is written / appended at position j exactly as a chain's token
j (``buf[:, j]``, ring slot ``head+1+j``, history ``pos0 + j``); the strategy's ``compact_path``
then moves the accepted path into chain order before the commit. Each call raises ValueError on
inconsistent shapes, non-fp32 states or states not contiguous per slot.
"""

from __future__ import annotations

import abc
import copy
import os
import sys
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["BACKENDS", "FLOAT_DTYPES", "LaunchConfig", "RollbackKernels", "Conv1dKernels", "BackendOp", "SSMOp", "triton_interpreting"]

#: the floating-point dtypes specdec's Triton kernels compute in (anything else keeps PyTorch's path)
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def triton_interpreting() -> bool:
    """Whether Triton kernels run in Triton's CPU interpreter in this process (``TRITON_INTERPRET``
    set to a true value; it takes effect for kernels defined after it is set)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on", "y")


def _triton_language_compiled() -> bool:
    """Whether ``triton.language`` was imported with its own jit functions (``tl.zeros``, ``cdiv``,
    ...) built for compilation, not for the interpreter: then no kernel can be interpreted, even
    with ``TRITON_INTERPRET`` set since. False when it is not imported yet (or cannot be told)."""
    standard = sys.modules.get("triton.language.standard")
    fn = getattr(standard, "cdiv", None)
    if fn is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(fn, InterpretedFunction)

#: kernel backends: the fp32 torch reference, and the fused Triton kernels
BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class LaunchConfig:
    """Launch settings of a kernel set's calls; ``None`` keeps the op's hand-picked default.

    The kernels update state in place, so they are never autotuned at run time; these
    overrides exist for tests (several programs per head, masks) and for tuning sweeps
    (``benchmarks/sweep_rollback_configs.py``).

    Attributes:
        block: state block per program: value columns BV (GDN / KDA) or head-dim rows BP
            (Mamba-2); rounded up to a power of two and capped at the dim.
        num_warps: warps per program.
        prefetch: step tokens whose inputs are requested before the first arithmetic.
        tree_loop: walk a tree's nodes in a loop at run time (True) or unrolled (False);
            None: unrolled up to ``triton_common.TREE_UNROLL_MAX`` nodes.
    """

    block: int | None = None
    num_warps: int | None = None
    prefetch: int | None = None
    tree_loop: bool | None = None


class RollbackKernels(Protocol):
    """The fused kernels of one SSM op, one method per rollback primitive (an op's ``kernels``).

    State shape ``*S`` is the op's (Mamba-2 ``[H, P, N]``, GDN / KDA ``[H, K, V]``); ``T_max`` the
    store's step room. Each ``*_verify`` and :meth:`update` returns the outputs ``[B, t, ...]``.
    """

    #: the launch settings the calls use (:class:`LaunchConfig`; all None = the defaults)
    launch: LaunchConfig

    def with_launch(self, launch: LaunchConfig) -> RollbackKernels:
        """The same kernels launched with ``launch`` (a new object; this one is unchanged)."""
        ...

    def update(self, state: torch.Tensor, inputs: dict, params: dict, *,
               state_indices: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """No rollback: run the t tokens from ``state [num_slots, *S]`` and overwrite it with
        s^(t) (the in-place strategy of plain decoding; also the benchmarks' floor)."""
        ...

    def snapshot_verify(self, live: torch.Tensor, buf: torch.Tensor, inputs: dict, params: dict, offset: int, *,
                        state_indices: torch.Tensor | None = None, parents: tuple | None = None,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        """Snapshot verify: start from ``live [num_slots, *S]`` (offset 0, read only) or
        ``buf[:, offset-1]``; write s^(offset+1 .. offset+t) into ``buf[:, offset : offset+t]``
        (``buf [num_slots, T_max, *S]``; other positions untouched). Needs ``offset + t <= T_max``."""
        ...

    def snapshot_commit(self, live: torch.Tensor, buf: torch.Tensor, num_tokens: torch.Tensor, *,
                        state_indices: torch.Tensor | None = None) -> None:
        """Snapshot commit: ``live[i] = buf[i, n - 1]`` for each row with ``n = num_tokens[b] > 0``
        (``i`` its slot); ``n = 0`` keeps the live state."""
        ...

    def ring_verify(self, ring: torch.Tensor, head: torch.Tensor, inputs: dict, params: dict, offset: int, *,
                    state_indices: torch.Tensor | None = None, parents: tuple | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """Ring verify: start from slot ``(head+offset) % R`` of ``ring [num_slots, R, *S]``; write
        s^(offset+1+j) into slot ``(head+offset+1+j) % R``; ``head [num_slots]`` is read only.
        Needs ``offset + t < R`` (the committed slot is never overwritten)."""
        ...

    def ring_commit(self, head: torch.Tensor, num_tokens: torch.Tensor, ring_size: int, *,
                    state_indices: torch.Tensor | None = None) -> None:
        """Ring commit in one launch: ``head[i] = (head[i] + num_tokens[b]) % ring_size`` (no state moves)."""
        ...

    def replay_verify(self, ckpt: torch.Tensor, hist: dict, hist_len: torch.Tensor, inputs: dict, params: dict,
                      offset: int, *, fused: bool = False, state_indices: torch.Tensor | None = None,
                      parents: tuple | None = None, out: torch.Tensor | None = None,
                      fold_max: int | None = None) -> torch.Tensor:
        """Replay verify: outputs from the checkpoint ``ckpt [num_slots, *S]`` and the input history
        ``hist`` (``{key: [num_slots, L, ...]}``, the keys of ``op.replay_spec``), writing no step state.

        * ``fused=False`` (deferred replay): outputs from ``ckpt`` advanced by the first
          ``hist_len[i] + offset`` cached tokens; this call's replay inputs are appended at
          positions ``hist_len[i] + offset + j``; ``ckpt`` and ``hist_len`` are not written.
          Commit: :meth:`replay_fold` of the rows whose history would overflow.
        * ``fused=True`` (eager replay, the fold fused into the next verify; ``L = 2 T_max``,
          ``hist_len <= T_max``): the step's first call (offset 0) folds the first
          ``hist_len[i]`` cached tokens into ``ckpt`` in place (the step's one state write: the
          checkpoint becomes s^(0)); outputs from ``ckpt`` advanced by the step's first
          ``offset`` tokens (positions ``T_max ..``); appends at ``T_max + offset + j``.
          Commit: :meth:`replay_commit` (no state traffic). A fused step must be closed by that
          commit (zero tokens to discard it): the checkpoint already holds its starting state.
          ``fold_max`` (offset 0): the most committed positions any slot's history holds
          (``hist_len <= fold_max <= T_max``, not checked on device; None: ``T_max``): the fold
          is sized for it, as in a decoder sized for the step.
        """
        ...

    def replay_fold(self, ckpt: torch.Tensor, hist: dict, params: dict, num_tokens: torch.Tensor, *,
                    state_indices: torch.Tensor | None = None) -> None:
        """Replay fold: ``ckpt[i]`` advanced by its first ``num_tokens[b]`` cached tokens, in place
        (rows with ``num_tokens == 0`` move no state)."""
        ...

    def replay_commit(self, hist: dict, hist_len: torch.Tensor, num_tokens: torch.Tensor, *,
                      state_indices: torch.Tensor | None = None, max_tokens: int | None = None) -> None:
        """Commit of fused replay in one launch: move history positions ``T_max .. T_max + n - 1``
        to ``0 .. n - 1`` and set ``hist_len[i] = n = num_tokens[b]`` (no state traffic);
        ``max_tokens``: the step's width, ``n <= max_tokens <= T_max`` (None: ``T_max``), which
        the launch is sized for."""
        ...


class Conv1dKernels(Protocol):
    """The fused causal depthwise conv over a multi-token window (``conv1d_op(...).kernels``).

    Window layout and semantics: :mod:`specdec.kernels.conv1d.naive` (``window [num_slots, C,
    W-1+T_max]``: committed history at columns ``0 .. W-2``, step token j at ``W-1+j``).
    """

    def verify(self, window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None, offset: int, *, state_indices: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``x [B, t, C]`` at columns ``W-1+offset ..`` and return the conv outputs ``[B, t, C]``."""
        ...

    def tree_verify(self, window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    activation: str | None, parents: tuple, *, state_indices: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`verify` of a tree (offset 0): token j's conv runs over its ancestor chain."""
        ...

    def commit(self, window: torch.Tensor, num_tokens: torch.Tensor, width: int, *,
               state_indices: torch.Tensor | None = None) -> None:
        """History := the W-1 conv inputs ending at each row's ``num_tokens[b]``-th step token."""
        ...

    def update(self, window: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               activation: str | None, *, state_indices: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """A plain step in one launch: :meth:`verify` of ``x [B, 1, C]`` at offset 0, then
        :meth:`commit` of that token for every row; returns ``[B, 1, C]``."""
        ...

    def prompt(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
               history: torch.Tensor | None = None) -> torch.Tensor:
        """The conv of a whole prompt ``x [B, L, C]`` from ``history [B, W-1, C]`` or zeros (no window)."""
        ...


class BackendOp(abc.ABC):
    """An op with a torch reference and a lazily bound Triton kernel set.

    The instances in the registries (:data:`specdec.kernels.OPS`, ``CONV1D``) are the torch
    reference (``kernels`` is None); :meth:`on` gives the op on a backend. Subclasses set
    ``name`` and implement :meth:`triton_kernels`.
    """

    name: str = ""
    #: the fused Triton kernels, or None for the torch reference
    kernels = None

    @property
    def backend(self) -> str:
        """``"triton"`` when ``kernels`` is bound, else ``"torch"``."""
        return "torch" if self.kernels is None else "triton"

    @abc.abstractmethod
    def triton_kernels(self):
        """This op's Triton kernel set: imports the op's Triton module (first use only)."""

    def on(self, backend: str, device: torch.device | str | None = None):
        """This op on ``backend`` (one of :data:`BACKENDS`).

        ``"torch"``: the reference op. ``"triton"``: a copy of the reference with ``kernels``
        bound to :meth:`triton_kernels`, made once and shared. For a ``device`` that is not
        CUDA the kernels run through Triton's interpreter: ``TRITON_INTERPRET=1`` is set before
        the kernel module is imported (it only takes effect if no Triton kernel was defined
        earlier in the process: set it yourself before importing ``specdec`` to be sure); with
        ``device=None`` the environment is left as it is (e.g. to bind a layer's conv op to the
        backend its recurrence already runs on). The interpreter is for testing only: exact,
        but orders of magnitude slower than the torch reference.

        Raises:
            ValueError: ``backend`` is not one of :data:`BACKENDS`.
            RuntimeError: Triton kernels for a device that is not CUDA after triton was imported
                with the interpreter off (it can no longer take effect).
        """
        if backend not in BACKENDS:
            raise ValueError(f"unknown kernel backend {backend!r}; use one of {BACKENDS}")
        reference = self.__dict__.get("_reference", self)
        if backend == "torch":
            return reference
        bound = reference.__dict__.get("_triton")
        if bound is None:
            if device is not None and torch.device(device).type != "cuda":
                if _triton_language_compiled():
                    raise RuntimeError(
                        f"the {self.name} op's Triton kernels on {torch.device(device)} need Triton's interpreter, "
                        "which must be on before triton is first imported (here it was not, and triton already "
                        "was, e.g. by torch or transformers): set TRITON_INTERPRET=1 before importing torch, or "
                        "use SPECDEC_BACKEND=torch")
                os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules define their kernels
            bound = copy.copy(reference)
            bound.kernels = reference.triton_kernels()
            bound._reference = reference
            reference._triton = bound
        return bound


class SSMOp(BackendOp):
    """One recurrence type, so rollback strategies do not care which recurrence runs.

    Subclasses set ``name`` and ``replay_keys`` and implement ``verify`` / ``fold`` (the fp32
    torch reference of ``naive.py``) and :meth:`~BackendOp.triton_kernels`. ``inputs`` and
    ``params`` are plain dicts so that adapters of different families (which project and gate
    differently) hand the same op the same names.
    """

    replay_keys: tuple[str, ...] = ()
    #: the fused per-strategy kernels (Triton), or None for the torch reference: the rollback
    #: strategies then call them instead of composing ``verify`` and ``fold``
    kernels: RollbackKernels | None = None

    def replay_spec(self, inputs: dict) -> dict:
        """``{key: (per-token shape, dtype)}`` of the inputs replay caches, from a step's ``inputs``."""
        return {k: (tuple(inputs[k].shape[2:]), torch.float32) for k in self.replay_keys}

    @abc.abstractmethod
    def verify(self, state, inputs: dict, params: dict, return_states: bool):
        """Run the step's T tokens from ``state [B, *S]`` (not modified): ``(y [B, T, ...],
        states [B, T, *S] | None, replay_inputs)``; ``replay_inputs`` is the dict of per-token
        tensors replay caches (``replay_keys``), each ``[B, T, ...]``."""

    @abc.abstractmethod
    def fold(self, state, replay: dict, params: dict, num_tokens: torch.Tensor):
        """The state after applying the first ``num_tokens[b]`` cached tokens of each row (the
        replay / deferred-fold primitive)."""

    def with_launch(self, launch: LaunchConfig) -> SSMOp:
        """This op with its kernels launched with ``launch`` (a copy; the reference op, which has
        no kernels, is returned as it is)."""
        if self.kernels is None:
            return self
        out = copy.copy(self)
        out.kernels = self.kernels.with_launch(launch)
        return out

    def tree_verify(self, state, inputs: dict, params: dict, parents, return_states: bool):
        """:meth:`verify` for a tree of step tokens (the torch reference; with ``kernels`` set the
        rollback strategies call the kernels' ``*_verify(..., parents=)`` instead): token j
        starts from token ``parents[j]``'s state (``-1``: ``state``), ``parents[j] < j``; states
        and replay inputs are per token of the tree. See :mod:`specdec.kernels.tree_index`."""
        raise NotImplementedError(f"SSM op {self.name!r} has no tree verify")
