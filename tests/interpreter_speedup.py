"""Test support: skip two repeated costs in Triton's CPU interpreter.

Inside a kernel, the interpreter patches `triton.language` again at every call of a @triton.jit helper (its
`_patch_lang`), although the kernel's own patch of the same modules is in place until the kernel ends (and the
repeat is never undone). Our kernels call small helpers in their loops, so the repeats took about a third of an
engine test's interpreter time (a tiny Qwen3's three-prompt greedy run: 1,066 patches, 1.07 of 3.7 s; cProfile on
the CPU). This skips a helper's patch when every language module it sees (`triton.language`,
`triton.language.core`) was patched already in the running kernel; a helper that sees another one (the standard
library's `tl.zeros` sees `core`) is patched as before. If Triton's interpreter no longer has these names, nothing
is changed. The kernels' results are checked against references by the tests themselves.

The interpreter also maps a Triton dtype to numpy's by building a 19-entry dict at every call (`_get_np_dtype`,
about 370,000 calls and 7 of 122 s under cProfile in tests/test_rope_store.py): the answers are kept here per
dtype instead."""


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
    seen: dict[object, frozenset[int]] = {}  # helper -> the language modules its globals hold

    def langs_of(fn) -> frozenset[int]:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)
        return seen[fn]

    def patch_once(fn):
        langs = langs_of(fn)
        if patched and langs <= patched:  # a helper inside a kernel that patched these already
            return _AlreadyPatched()
        kernel = not patched  # the kernel's own patch (GridExecutor's): forget the set when it is restored
        scope = patch_lang(fn)
        patched.update(langs)
        if kernel:
            restore = scope.restore

            def restore_and_forget() -> None:
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        return scope

    patch_once.skips_repeats = True
    interpreter._patch_lang = patch_once
    np_dtype = getattr(interpreter, "_get_np_dtype", None)
    if callable(np_dtype):
        interpreter._get_np_dtype = _remembered(np_dtype, tl)
    return True


def _remembered(np_dtype, tl):
    """np_dtype's answers kept per element dtype (a block's is its element's, as np_dtype itself answers; pointers
    go straight to np_dtype)."""
    answers: dict = {}

    def remembered(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        if isinstance(key, tl.pointer_type):  # unhashable; np_dtype answers it at its first check
            return np_dtype(key)
        if key not in answers:
            answers[key] = np_dtype(key)
        return answers[key]

    return remembered
