"""Triton's interpreter made cheaper for the suite, computing the same: helpers called inside a kernel
do not re-patch triton.language, and no integer overflow is checked that could never be reported."""

from __future__ import annotations

import dataclasses


def skip_unreported_overflow_checks() -> None:
    """Each integer +, - and * in an interpreted kernel is computed again in int64 and compared with
    the type's bounds for a device_assert, which does nothing unless the options' debug is set; the
    interpreter's never is (a GPU build drops the unused check too). Without debug it is skipped: the
    same values, a third less time (docs/benchmarks.md, the 53rd VM)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if dataclasses.is_dataclass(options) and not options.debug and getattr(options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)


def skip_repeated_patches() -> None:
    """A @triton.jit helper called inside a kernel re-patches triton.language, which the kernel's
    launch has already patched (a scan of the modules' members per call); here a helper patches only
    what the launch did not."""
    from triton.runtime import interpreter

    needed = ("GridExecutor", "InterpretedFunction", "InterpreterError", "tl")
    if getattr(interpreter, "_switchyard_patched", False) or not all(hasattr(interpreter, n) for n in needed):
        return  # another Triton's interpreter: left as it is
    patched: list[set[int]] = []  # the language modules patched since each running launch began

    def langs(fn) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if v is interpreter.tl or v is interpreter.tl.core)

    launch, nested = interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__

    def launch_once(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def call_helper(self, *args, **kwargs):
        if not patched or not langs(self.fn) <= patched[-1]:
            if patched:
                patched[-1] |= langs(self.fn)
            return nested(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = launch_once, call_helper
    interpreter._switchyard_patched = True
