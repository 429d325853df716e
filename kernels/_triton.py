"""Launch helpers shared by the Triton launchers: backend choice and running a kernel on CPU tensors.

`triton.jit` decides at decoration time whether a kernel is compiled or interpreted: TRITON_INTERPRET is read when
each jit function is defined, triton.language's own helpers (tl.max, tl.sum, ...) included, so it must be set before
triton is first imported. CPU tests therefore set it at the top of their module (tests/kernels/).
"""
from __future__ import annotations

import functools

import torch

def use_triton(device: torch.device, backend: str | None) -> bool:
    """backend None: Triton on CUDA, the torch reference elsewhere; "triton" / "ref" force one."""
    if backend not in (None, "triton", "ref"):
        raise ValueError(f"backend must be None, 'triton' or 'ref', got {backend!r}")
    if backend is None:
        return device.type == "cuda"
    return backend == "triton"


def runnable(kernel, device: torch.device):
    """The kernel to index with a grid. On CUDA the compiled kernel; on other devices the kernel must have been
    built by the interpreter (TRITON_INTERPRET=1 before triton was first imported), else a clear error."""
    if device.type == "cuda":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 in the environment before triton "
                           "is first imported (triton.language's own helpers are built at import time)")
    _numpy_index_shim()
    return kernel


_ARRIVAL_COUNTERS: dict[tuple[str, torch.device], torch.Tensor] = {}
# Buffers replaced by a larger one. A CUDA graph captured with the old buffer keeps its address and replays
# into it, so it must never be freed (the allocator would hand the memory to another tensor); they are few and
# small (a buffer only grows past the largest decode batch seen).
_RETIRED_COUNTERS: list[torch.Tensor] = []


def arrival_counters(owner: str, n: int, device: torch.device,
                     min_size: int = 1024) -> torch.Tensor | None:
    """A zeroed int32 [>= n] buffer of `owner`'s kernels, which count arriving programs in it and leave it zeroed
    again (the last program to arrive does the tail work). None when it would have to be (re)allocated during
    CUDA-graph capture: the caller then takes its path without counters. One stream at a time per owner.
    Growing the buffer keeps the old one alive (`_RETIRED_COUNTERS`): graphs captured with it still use it."""
    key = (owner, device)
    buf = _ARRIVAL_COUNTERS.get(key)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        if buf is not None:
            _RETIRED_COUNTERS.append(buf)
        buf = _ARRIVAL_COUNTERS[key] = torch.zeros(max(n, min_size), dtype=torch.int32, device=device)
    return buf


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (132 on an H200); the H200's count elsewhere, so CPU tests
    exercise the same split choices as the GPU."""
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 132


_SHIMMED = False


def _numpy_index_shim() -> None:
    """Let the triton 3.6 interpreter use a loaded scalar as a loop bound under numpy >= 2.4.

    The interpreter holds a scalar as a 1-element 1-d array and converts it with int(array), which numpy 2.4 turned
    from a deprecation warning into a TypeError; `range(s, n, step)` with a loaded `n` then fails. Wrap the
    interpreter's tensor patching so that __index__ reads the single element instead. CPU interpreter only.
    """
    global _SHIMMED
    if _SHIMMED:
        return
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _SHIMMED = True
