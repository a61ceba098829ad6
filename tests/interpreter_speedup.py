"""Test support: skip a repeated cost in Triton's CPU interpreter.

Inside a kernel, the interpreter patches `triton.language` again at every call of a @triton.jit helper (its
`_patch_lang`), although the kernel's own patch of the same modules is in place until the kernel ends (and the
repeat is never undone). Our kernels call small helpers in their loops, so the repeats took about a third of an
engine test's interpreter time (a tiny Qwen3's three-prompt greedy run: 1,066 patches, 1.07 of 3.7 s; cProfile on
the CPU). This skips a helper's patch when every language module it sees (`triton.language`,
`triton.language.core`) was patched already in the running kernel; a helper that sees another one (the standard
library's `tl.zeros` sees `core`) is patched as before. If Triton's interpreter no longer has these names, nothing
is changed. The kernels' results are checked against references by the tests themselves."""


class _AlreadyPatched:
    """What a skipped patch returns (the interpreter discards a helper's scope; the kernel's own restores)."""

    def restore(self) -> None:
        pass


def install() -> bool:
    """Wrap triton.runtime.interpreter._patch_lang once; True when it is (now or before) wrapped."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang, tl = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "tl", None)
    if not callable(patch_lang) or tl is None:
        return False
    if getattr(patch_lang, "skips_repeats", False):
        return True
    patched: set[int] = set()  # ids of the language modules patched in the running kernel (empty between kernels)
    kernel: list = []  # the running kernel's patch scope
    seen: dict[object, frozenset[int]] = {}  # helper -> the language modules its globals hold

    def langs_of(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[fn]

    def patch_once(fn):
        langs = langs_of(fn)
        if kernel and langs <= patched:
            return _AlreadyPatched()
        scope = patch_lang(fn)
        patched.update(langs)
        if not kernel:  # the kernel's own patch (GridExecutor): forget the set when it is restored
            restore = scope.restore

            def restore_and_forget() -> None:
                kernel.clear()
                patched.clear()
                restore()

            scope.restore = restore_and_forget
            kernel.append(scope)
        return scope

    patch_once.skips_repeats = True
    interpreter._patch_lang = patch_once
    return True
