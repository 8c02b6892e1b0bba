"""Helpers for Triton-interpreter checks (scripts run with TRITON_INTERPRET=1 in a subprocess)."""


def patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a tensor used as a loop bound into an int with int(ndarray);
    numpy >= 2.4 rejects that for 1-element arrays. Test-side fix only."""
    import numpy as np
    from triton.runtime import interpreter

    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_voltllm_patched", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._voltllm_patched = True
    interpreter._patch_lang_tensor = patched
