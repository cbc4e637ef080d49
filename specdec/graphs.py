"""CUDA graphs: capture with PyTorch's recipe, shape buckets, and what blocks a capture.

Every graph-captured program of the project — the target's verify forward and commit
(:class:`specdec.decoding.StaticDecoder`) and the drafters' proposals
(:class:`specdec.drafters.DraftModelDrafter`, :class:`specdec.drafters.MTPDrafter`, through
:class:`CapturedProgram`), the decode loop's work around a greedy chain step's forward (through
:class:`CapturedProgram` too) — captures through :func:`capture`, so a failure is handled and
reported one way: the caller keeps running the same static program without graphs and records
:class:`CaptureFailure`'s reason, which ``generate()`` reports in ``Stats.capture_error`` (and
warns once). The rollback flush between steps (:meth:`specdec.cache.HybridCache.flush`, a
:class:`CapturedProgram`) only warns: a failure there leaves the steps' graphs as they are.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import types
import warnings

import torch

from .fusion import fused, fusion_enabled

__all__ = ["CaptureFailure", "CapturedProgram", "bucket_length", "bucket_width", "capture", "capture_blocker",
           "capture_stream", "gc_paused", "graph_safe_experts", "warmups_run"]

_WARMUPS = threading.local()  # .count: this thread's captures and CapturedProgram warm-ups


def warmups_run() -> int:
    """How many graph captures (:func:`capture`: a decoder's widths, prompt buckets, programs) and
    eager warm-ups of a capturing :class:`CapturedProgram` this thread has run so far: each takes
    many times a replay (a capture synchronises the device twice), so a step that ran one is no
    measure of a step's cost (the speculation policy leaves it out:
    :meth:`specdec.adaptive.SpeculationPolicy.unmeasured`)."""
    return getattr(_WARMUPS, "count", 0)


def _warmed_up() -> None:
    _WARMUPS.count = warmups_run() + 1


def bucket_length(n: int, multiple: int = 256) -> int:
    """KV columns for ``n`` needed ones, rounded up so nearby lengths share one CUDA graph."""
    return -(-n // multiple) * multiple


#: the narrowest :func:`bucket_width`
_MIN_WIDTH = 32


def bucket_width(n: int) -> int:
    """``n`` rounded up to the next of 32, 48, 64, 96, 128, 192, ... (``2^k`` and ``3 * 2^(k-1)``:
    at most a third of the result is beyond ``n``, from 32 on); 0 for 0."""
    if n <= 0:
        return 0
    W = _MIN_WIDTH
    while W < n:
        W = W * 3 // 2 if W & (W - 1) == 0 else W // 3 * 4  # 32 -> 48 -> 64 -> 96 -> 128 ...
    return W


def _grouped_mm_is_graph_safe(weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` runs its CUDA kernel on these weights: bf16 on sm90 / sm100
    only; elsewhere (other dtypes, other GPUs, CPU) PyTorch's fallback copies the group offsets
    to the host, which a CUDA graph cannot capture."""
    if weight.dtype != torch.bfloat16 or not weight.is_cuda:
        return False
    return torch.cuda.get_device_capability(weight.device)[0] in (9, 10)


def _host_syncing_experts(model: torch.nn.Module) -> list:
    """Configs of the model's mixture-of-experts blocks whose experts implementation syncs with
    the host, so it cannot be captured: transformers' ``"eager"`` experts (``nonzero`` to find the
    hit experts) and ``"grouped_mm"`` where :func:`_grouped_mm_is_graph_safe` says no."""
    configs = {}
    for mod in model.modules():
        cfg = getattr(mod, "config", None)
        impl = getattr(cfg, "_experts_implementation", None)
        weight = getattr(mod, "gate_up_proj", None)
        if weight is None:
            weight = getattr(mod, "up_proj", None)
        if impl is None or not hasattr(mod, "has_gate") or not isinstance(weight, torch.Tensor):
            continue  # not a transformers experts module (``@use_experts_implementation``)
        if impl == "eager" or (impl == "grouped_mm" and not _grouped_mm_is_graph_safe(weight)):
            configs[id(cfg)] = cfg
    return list(configs.values())


@contextlib.contextmanager
def graph_safe_experts(model: torch.nn.Module):
    """Inside the block, mixture-of-experts blocks whose experts implementation syncs with the
    host (:func:`_host_syncing_experts`) run transformers' ``"batched_mm"`` experts instead
    (gathers each token's expert weights and multiplies batched: no host sync, so it can be
    captured; its memory grows with tokens x top-k x expert size: small for a chain step's B x
    (K + 1) tokens, B x N for a draft tree's N nodes, e.g. 64 x batch for Medusa's 64-node tree).
    The model's setting is restored on exit; a captured graph keeps the batched kernels."""
    configs = _host_syncing_experts(model)
    saved = [cfg._experts_implementation for cfg in configs]
    if configs:
        warnings.warn(
            f"the model's experts implementation ({', '.join(sorted(set(saved)))}) syncs with the host for these "
            "weights (dtype / GPU); the CUDA graph is captured with transformers' 'batched_mm' experts instead",
            RuntimeWarning, stacklevel=4,
        )
    try:
        for cfg in configs:
            cfg._experts_implementation = "batched_mm"
        yield
    finally:
        for cfg, impl in zip(configs, saved, strict=True):
            cfg._experts_implementation = impl


def capture_blocker() -> str | None:
    """Why no CUDA graph can be captured in this process, or None.

    ``TRITON_INTERPRET=1`` makes every Triton kernel defined or built after it is set -- ours and
    the ones ``torch.compile`` generates for :mod:`specdec.fusion` -- run in Triton's CPU
    interpreter, which copies its tensor arguments to the host and back on each launch: that
    cannot be captured (and Inductor's kernels cannot be interpreted at all). It holds for the
    whole process, so a library or test module that sets it at import turns graphs off for
    everything after it."""
    from .kernels.protocol import triton_interpreting

    if triton_interpreting():
        return (f"TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r} is set: Triton kernels run in Triton's CPU "
                "interpreter, which "
                "copies tensors to the host and cannot be captured; unset it to use CUDA graphs")
    return None


class CaptureFailure(RuntimeError):
    """A CUDA-graph capture failed; ``reason`` is the original error as ``"Type: message"``."""

    def __init__(self, what: str, err: BaseException):
        self.reason = f"{type(err).__name__}: {err}"
        super().__init__(f"CUDA-graph capture of {what} failed ({self.reason})")


def capture(fn, *, model: torch.nn.Module | None, what: str, warmup: int = 2, warmup_fn=None, fuse: bool | None = None,
            pool=None, compiled_whole: bool = False) -> tuple[torch.cuda.CUDAGraph, object]:
    """Capture ``fn()`` (no arguments; it reads and writes fixed tensors) as a CUDA graph.

    PyTorch's recipe: ``warmup`` runs on a side stream (compiles kernels, allocates lazy
    buffers), then one capture. Inside, the model's norms / MLPs and the :func:`~specdec.fusion.fusable`
    functions run through ``torch.compile`` (:mod:`specdec.fusion`; ``fuse`` defaults to
    ``SPECDEC_FUSE``; the warm-up compiles, so fusing needs ``warmup >= 1``) and host-syncing MoE experts
    through :func:`graph_safe_experts`. Python's garbage collector is paused during the capture
    (:func:`gc_paused`). Capturing does not run the work: replay the graph for this call's result.

    Args:
        fn: the program. model: the HF model it runs (None: a program that runs none). what: its
            name, for errors.
        warmup: side-stream runs before the capture (0 when the caller ran ``fn`` already).
        warmup_fn: what the warm-up runs instead of ``fn`` (e.g. a forward and its commit).
        pool: a graph memory pool to share (``other_graph.pool()``).
        compiled_whole: ``fn`` is a program compiled whole: the norms / MLPs keep their own
            forwards (``fused(modules=False)``), which its compile fuses.

    Returns: ``(graph, the outputs of the captured call)``.

    Raises: :class:`CaptureFailure` (with the original error) when any step fails, or at once when
        :func:`capture_blocker` names a reason; the device is synchronised first so the caller
        can run ``fn`` eagerly instead.
    """
    _warmed_up()
    blocker = capture_blocker()
    if blocker is not None:
        raise CaptureFailure(what, RuntimeError(blocker))
    fuse = fusion_enabled() if fuse is None else bool(fuse)
    dev = torch.cuda.current_device()
    model_ctx = ((fused(model, fuse, modules=not compiled_whole), graph_safe_experts(model))
                 if model is not None else (fused(None, fuse), contextlib.nullcontext()))
    try:
        with model_ctx[0], model_ctx[1]:
            if warmup:
                side = torch.cuda.Stream(device=dev)
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    for _ in range(warmup):
                        (warmup_fn or fn)()
                torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with gc_paused(), torch.cuda.graph(graph, pool=pool, stream=capture_stream(dev)):
                out = fn()
    except Exception as err:  # noqa: BLE001 -- any failure (an op that syncs with the host, out of memory)
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(dev)
        raise CaptureFailure(what, err) from err
    return graph, out


def capture_stream(index: int) -> torch.cuda.Stream:
    """The stream :func:`capture` captures CUDA graphs of CUDA device ``index`` on: one per
    device, made on first use. ``torch.cuda.graph`` without a stream captures on one stream of
    the whole process, made on the device current at the process's first capture, so a model on
    another device would be captured there."""
    with _CAPTURE_LOCK:
        stream = _CAPTURE_STREAMS.get(index)
        if stream is None:
            stream = _CAPTURE_STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


_CAPTURE_LOCK = threading.Lock()
_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}  # device index -> capture_stream's


@contextlib.contextmanager
def gc_paused():
    """Python's automatic garbage collection off inside (as it was after). A collection during a
    capture may free an unreachable CUDA graph (e.g. of a generator no longer referenced), whose
    destruction is not permitted while a stream captures: it invalidates the capture
    (``cudaErrorStreamCaptureInvalidated``) and leaves the CUDA generator mid-capture, so later
    random ops fail. ``torch.cuda.graph`` collected before capturing up to PyTorch 2.8; later
    versions do not (https://github.com/pytorch/pytorch/pull/161037).

    The collector is one switch for the process: blocks on several threads at once are counted,
    and the last one out turns it back to what it was before the first one came in."""
    with _GC_LOCK:
        if not _GC_PAUSES[0]:
            _GC_PAUSES[1] = gc.isenabled()
            gc.disable()
        _GC_PAUSES[0] += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _GC_PAUSES[0] -= 1
            if not _GC_PAUSES[0] and _GC_PAUSES[1]:
                gc.enable()


_GC_LOCK = threading.Lock()
_GC_PAUSES = [0, False]  # blocks inside gc_paused, and whether the collector was on before the first


def _own_frame(fn, name: str):
    """A function calling ``fn()`` through a code object of its own. Dynamo keeps compiled
    entries, and counts recompiles against its limit, per code object: programs made from one
    function (a drafter's per shape bucket, the step's per kind and K) would otherwise share one
    list, each program's compile a "recompile" of the others', and past the limit (8) a program
    would run uncompiled. ``name``: the code object's, as dynamo's messages name it."""
    def call():
        return fn()

    return types.FunctionType(call.__code__.replace(co_name=name), call.__globals__, name, None, call.__closure__)


class CapturedProgram:
    """A fixed-shape program ``fn()`` (a drafter's proposal, or the decode loop's work around a
    step's forward; it reads and writes fixed tensors): run
    eagerly on its first call and, with ``graphs``, captured by :func:`capture` on its second and
    replayed from then on. The first call is the capture's warm-up, run with the same kernels as
    the capture (fused norms / MLPs, graph-safe MoE experts). When the capture fails the program
    warns, keeps the reason in ``error``, calls ``on_failure()`` (e.g. to reset host-side
    counters the capture advanced) and runs eagerly from then on.

    With ``compile_whole`` (and fusion on, :func:`specdec.fusion.fusion_enabled`) the warm-up and
    the capture run the whole program through ``torch.compile(fullgraph=True)`` instead: one
    Inductor graph fuses everything between the GEMMs (norms, rotary, masks, the KV write,
    casts, argmax), not only the norms / MLPs, for a program of many small ops whose kernels,
    not bytes, bound it. ``fullgraph`` means the compile either traces all of it before anything
    runs or fails with nothing run; such a failure (a ``torch._dynamo`` exception, a recompile
    limit hit included; an error of the compiled program's run is raised) is kept in
    ``compile_error``, warned about once, and the program runs as without ``compile_whole``
    (still captured). So does a compiled program whose capture fails: that call runs it
    uncompiled as the warm-up, and the next captures it uncompiled.

    Args: fn: the program. model: the module it runs (fusion and experts are switched on it; None: a
        program that runs no module).
        what: its name, for messages. graphs: capture at all (CUDA only). compile_whole: compile
        the whole program before capturing it (only where it is captured). fuse: run the norms /
        MLPs fused while warming up and capturing (default :func:`~specdec.fusion.fusion_enabled`;
        False for programs of many shapes, each of which would compile anew; it does not gate
        ``compile_whole``, which ``SPECDEC_FUSE=0`` turns off). pool: a graph
        memory pool to capture into (:func:`torch.cuda.graph_pool_handle`, shared by programs
        that are never replayed at once and whose outputs live outside the pool).

    Calling it runs the program once and returns how: ``"static"`` or ``"cuda_graph"``.
    """

    def __init__(self, fn, *, model: torch.nn.Module | None, what: str, graphs: bool, on_failure=None,
                 compile_whole: bool = False, fuse: bool | None = None, pool=None):
        self.fn, self.model, self.what, self.graphs, self.on_failure = fn, model, what, bool(graphs), on_failure
        self.fuse, self.pool = fuse, pool
        self.graph = None
        self.calls = 0
        #: why the capture failed (``"Type: message"``), or None
        self.error: str | None = None
        self.compile_whole = bool(compile_whole)
        self._compiled = None
        #: why compiling the whole program failed (``"Type: message"``), or None
        self.compile_error: str | None = None

    def _program(self):
        """What the warm-up and the capture run: the compiled program (see the class), or ``fn``."""
        if not (self.compile_whole and self.graphs and self.compile_error is None and fusion_enabled()):
            return self.fn
        if self._compiled is None:
            self._compiled = torch.compile(_own_frame(self.fn, f"captured_program[{self.what}]"), fullgraph=True,
                                           dynamic=False)
        return self._compiled

    def _fusing(self) -> bool:
        return fusion_enabled() if self.fuse is None else bool(self.fuse)

    def __call__(self) -> str:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
            return "cuda_graph"
        if self.graphs and self.error is None and self.calls >= 2:
            try:  # the previous call ran the program eagerly: it was the warm-up
                program = self._program()
                self.graph, _ = capture(program, model=self.model, what=self.what, warmup=0,
                                        fuse=self._fusing(), pool=self.pool, compiled_whole=program is not self.fn)
            except CaptureFailure as err:
                if self.on_failure is not None:
                    self.on_failure()
                if program is not self.fn:  # the uncompiled program: warmed up by this call, captured at the next
                    self.compile_error = f"capture of the compiled program: {err.reason}"
                    warnings.warn(f"{err}; {self.what} runs uncompiled from now on (captured at its next call)",
                                  RuntimeWarning, stacklevel=3)
                else:  # keep the static program, eagerly
                    self.error = err.reason
                    warnings.warn(f"{err}; {self.what} runs the static path eagerly", RuntimeWarning, stacklevel=3)
            else:
                self.graph.replay()  # capturing does not run the work: run this call's
                return "cuda_graph"
        warm = self.graphs and self.error is None
        if warm:  # (the warm-up before a capture: warmups_run)
            _warmed_up()
        program = self._program() if warm else self.fn
        with fused(self.model, warm and self._fusing(), modules=program is self.fn), (
                graph_safe_experts(self.model) if warm and self.model is not None else contextlib.nullcontext()):
            if program is self.fn:
                self.fn()
            else:
                try:  # fullgraph: a failed trace or compile has run nothing of the program
                    program()
                except (torch._dynamo.exc.TorchDynamoException,  # tracing / Inductor failed: uncompiled
                        torch._dynamo.exc.FailOnRecompileLimitHit) as err:  # (not a TorchDynamoException)
                    self.compile_error = f"{type(err).__name__}: {err}"
                    warnings.warn(f"torch.compile of {self.what} failed ({self.compile_error}); it runs uncompiled",
                                  RuntimeWarning, stacklevel=3)
                    self.fn()
        return "static"
