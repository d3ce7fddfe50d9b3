"""Triton's interpreter (TRITON_INTERPRET=1, the CPU runs of the fused kernels) without its
repeated language patching.

The interpreter runs a kernel's Python with triton.language patched to numpy versions: the
launch patches the modules the kernel's globals name (`_patch_lang`), and so does every call of
a @triton.jit helper inside it (tl.max, tl.sum, tl.sigmoid, engine/fused's dot and cast), for
each of a grid's programs, one by one. A helper's patching (inspect.getmembers over the
language's modules) is more than half the interpreter's time in tests/engine/test_fused.py;
within a launch it is redone for nothing: the launch's own patches are undone when the launch ends, a
helper's never (Triton 3.9), so once a launch has patched for one module's globals, patching for
them again changes no attribute. `patch_once_per_launch` makes the interpreter patch for each
module's globals once per launch; the kernels run the same numpy operations, to the same bits.
"""

from __future__ import annotations

import functools


def patch_once_per_launch() -> bool:
    """Wrap the interpreter's patching so that a launch patches for each module's globals once
    (module docstring) -> whether it was wrapped: not where the interpreter lacks the pieces
    named here (another Triton: then it runs as it comes)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not all(hasattr(interpreter, name) for name in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    patch_lang, launch_call = interpreter._patch_lang, interpreter.GridExecutor.__call__
    patched: set[int] | None = None          # ids of the globals patched for in the running launch

    @functools.wraps(launch_call)
    def launch(self, *args, **kwargs):
        nonlocal patched
        patched = set()
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            patched = None

    @functools.wraps(patch_lang)
    def patch_once(fn):
        if patched is None:
            return patch_lang(fn)
        if id(fn.__globals__) in patched:
            return interpreter._LangPatchScope()      # nothing to patch, nothing to undo
        patched.add(id(fn.__globals__))
        return patch_lang(fn)

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch
    return True
