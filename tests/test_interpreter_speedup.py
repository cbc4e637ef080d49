"""The test run's faster Triton interpreter (tests/interpreter_speedup.py) swaps exactly the
builtins Triton's own search swaps, before a launch and inside one (a jit helper's call)."""

from __future__ import annotations

import pytest
from markers import needs_triton_interpreter

pytestmark = needs_triton_interpreter


def test_cached_search_swaps_what_tritons_own_search_swaps():
    tl = pytest.importorskip("triton.language")
    from triton.runtime import interpreter

    cached = interpreter._patch_builtin
    assert getattr(cached, "cached", False), "conftest.py installs the cached search on a CPU run"
    search = cached.uncached  # Triton's own
    namespaces = [tl, tl.core, tl.core.tensor, tl.math]
    if hasattr(tl.core, "tensor_descriptor_base"):
        namespaces.append(tl.core.tensor_descriptor_base)

    def swapped(fn, inside_a_launch):
        outer = interpreter._LangPatchScope()
        scope = interpreter._LangPatchScope()
        try:
            if inside_a_launch:  # what the launch swapped already
                for ns in namespaces:
                    search(ns, interpreter.interpreter_builder, outer)
            for ns in namespaces:
                fn(ns, interpreter.interpreter_builder, scope)
            return [(id(obj), name) for obj, name, _ in scope._changes]
        finally:
            scope.restore()
            outer.restore()

    before = {(id(ns), name): getattr(ns, name) for ns in namespaces for name in dir(ns)}
    for inside in (False, True):
        assert swapped(cached, inside) == swapped(search, inside), inside
    assert swapped(search, False)  # (a launch swaps builtins; inside it none are left)
    assert not swapped(search, True)
    assert {(id(ns), name): getattr(ns, name) for ns in namespaces for name in dir(ns)} == before
