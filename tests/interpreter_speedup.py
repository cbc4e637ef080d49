"""A faster Triton interpreter for the CPU test run (not a test module).

Before each kernel launch, and again at every call of a ``@triton.jit`` helper inside a kernel,
Triton's interpreter (``triton.runtime.interpreter._patch_lang``) swaps every builtin of
``triton.language`` (and of its ``core``, ``tensor``, ``math`` and ``tensor_descriptor_base``)
for its interpreted form, finding them with ``inspect.getmembers`` over the whole namespace.
That search is about a fifth of the interpreter's time in these tests: the kernels call small
jit helpers inside their loops, and each call searches again, to find nothing left to swap.

:func:`cache_builtin_lookups` makes the search once, before any kernel runs, and from then on
swaps the builtins found then that are still themselves -- what the search would find and
swap: a builtin stays one until swapped, and the swaps (lambdas) are not builtins. The
interpreter's results are unchanged; only the search is skipped (tests/test_interpreter_speedup.py
checks that both swap the same names, before a launch and inside one). Written against Triton
3.6; where the interpreter's internals are not those, it changes nothing.
"""

from __future__ import annotations

import inspect


def cache_builtin_lookups() -> bool:
    """Install the cached builtin search into Triton's interpreter; True if installed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # (no Triton: the torch backend only)
        return False
    search = getattr(interpreter, "_patch_builtin", None)
    patch_attr = getattr(interpreter, "_patch_attr", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if search is None or patch_attr is None or is_builtin is None or getattr(search, "cached", False):
        return False
    if list(inspect.signature(search).parameters) != ["pkg", "builder", "scope"]:
        return False
    namespaces = [tl, tl.core, tl.core.tensor, tl.math]
    if hasattr(tl.core, "tensor_descriptor_base"):
        namespaces.append(tl.core.tensor_descriptor_base)
    # (the namespaces as imported: no kernel has run yet, so nothing is swapped)
    found = {id(ns): (ns, [(name, member) for name, member in inspect.getmembers(ns) if is_builtin(member)])
             for ns in namespaces}

    def cached_search(pkg, builder, scope):
        entry = found.get(id(pkg))
        if entry is None or entry[0] is not pkg:
            return search(pkg, builder, scope)
        for name, member in entry[1]:
            if getattr(pkg, name, None) is member:  # not swapped (by an enclosing launch) yet
                patch_attr(pkg, name, member, builder, scope)

    cached_search.cached, cached_search.uncached = True, search
    interpreter._patch_builtin = cached_search
    return True
