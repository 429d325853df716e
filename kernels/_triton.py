"""Launch helpers shared by the Triton launchers: backend choice and running a kernel on CPU tensors.

`triton.jit` decides at decoration time whether a kernel is compiled or interpreted: TRITON_INTERPRET is read when
each jit function is defined, triton.language's own helpers (tl.max, tl.sum, ...) included, so it must be set before
triton is first imported. CPU tests therefore set it at the top of their module (tests/kernels/).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def use_triton(device: torch.device, backend: str | None) -> bool:
    """backend None: Triton on CUDA, the torch reference elsewhere; "triton" / "ref" force one."""
    if backend not in (None, "triton", "ref"):
        raise ValueError(f"backend must be None, 'triton' or 'ref', got {backend!r}")
    if backend is None:
        return device.type == "cuda"
    return backend == "triton"


def step_jit(*, ints: tuple[str, ...] = (), ptrs: tuple[str, ...] = ()):
    """`triton.jit` for a kernel whose arguments `ints` (row counts, tile counts, table widths) and `ptrs` (views
    that start at a per-step offset: decode rows' `positions[npf:]`, the step's staged lists) change from step to
    step. Triton compiles a variant per integer argument's "== 1" and "divisible by 16" and per pointer's 16-byte
    alignment; with several such arguments a kernel met new combinations for minutes of serving, each compile a
    0.2-2 s stall of every request in the step (H200, benchmarks/probe_compiles.py: 107 variants, 76 s over the
    first 61 serving steps). These arguments are scalars in address arithmetic or loop bounds and the pointers are
    read an element at a time, so nothing vectorised is lost."""
    return triton.jit(do_not_specialize=list(ints), do_not_specialize_on_alignment=list(ptrs))


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


# Programmatic dependent launch (Hopper+): a decode kernel launched with it may start while the kernel before it
# drains (its programs wait in `pdl_enter` until that kernel is done and its writes are visible), which hides
# the launch gap between the small kernels of a decode step. PDL["enabled"] None: on wherever the GPU has it
# unless the environment sets M3SERVE_PDL=0; True/False force it. It pays at small batches only (H200, graph of
# many calls, us with / without, docs/benchmarks.md "PDL"): index + top-k 5.87 / 7.17 at B = 1, 14.4 / 16.1 at
# 16, equal at 64, 525 / 505 at 64 x 131k; sparse attention 6.67 / 7.95 at B = 1 but 30.2 / 26.4 at 16 (its
# folded merge, the last split of a row merging, then shares the SMs with the next call's waiting programs).
# So each launcher passes its own row limit (PDL_MAX_ROWS).
PDL: dict[str, bool | None] = {"enabled": None}
PDL_MAX_ROWS = {"attention": 4, "index": 16}


@functools.lru_cache(maxsize=None)
def _cuda_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on `device` launch with programmatic dependent launch (never on CPU / the interpreter)."""
    if device.type != "cuda":
        return False
    on = PDL["enabled"]
    if on is None:
        on = os.environ.get("M3SERVE_PDL", "1") != "0"
    return bool(on) and _cuda_capability(device.index if device.index is not None
                                         else torch.cuda.current_device())[0] >= 9


def pdl_launch(device: torch.device, kind: str, rows: int) -> tuple[dict, bool]:
    """(launch options, PDL constexpr) for a kernel of `kind` (PDL_MAX_ROWS) over `rows` decode rows that starts
    with `pdl_enter(PDL)`."""
    on = rows <= PDL_MAX_ROWS[kind] and use_pdl(device)
    return ({"launch_pdl": True} if on else {}), on


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    # First thing in a PDL-launched kernel: wait for the kernel before it (its writes become visible), then let
    # the next one launch. Waiting first keeps every read and write of this kernel after its predecessor's.
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


class CompiledLaunch:
    """Launches a Triton kernel straight through its compiled launcher once the JIT has compiled it for the same
    arguments' specialisation. The JIT's per-call work (binding ~50 arguments, specialising each, the cache key,
    the globals check) is host time on the critical path of an eager call, which PERF.md's single-call prefill
    method counts (docs/benchmarks.md P12: the fused sparse prefill launch ~106 us of host time, a bare launch
    ~16). The key here is stricter than Triton's (it holds every specialised integer's value, each tensor's dtype
    and 16-byte alignment, the constexprs and launch options), so a hit always names the variant the JIT would have
    picked. CUDA only, and only while no launch hook listens (a profiler then gets the JIT's metadata)."""

    MAX_ENTRIES = 64

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        # a JITFunction's parameters (an interpreted kernel, on CPU, never gets here)
        params = getattr(kernel, "params", ())
        self._names = [p.name for p in params]
        self._loose_at = [p.do_not_specialize for p in params if not p.is_constexpr]  # positional args only
        self._compiled: dict[tuple, object] = {}
        self.direct_launches = 0  # launches that skipped the JIT (tests read it)

    def _key(self, args: tuple, consts: dict, options: dict, device) -> tuple:
        key = [str(device), tuple(sorted(options.items())), *consts.values()]
        for loose, value in zip(self._loose_at, args):
            if isinstance(value, torch.Tensor):
                key.append((value.dtype, value.data_ptr() % 16 == 0))
            elif isinstance(value, bool):
                key.append(value)
            elif isinstance(value, int):
                key.append(-2**31 <= value < 2**31 if loose else value)
            else:
                key.append(type(value).__name__)
        return tuple(key)

    def _values(self, args: tuple, consts: dict) -> list:
        # the kernel's arguments in its order: the positional ones, then the constexprs by name
        return list(args) + [consts[n] for n in self._names[len(args):]]

    def __call__(self, grid: tuple, args: tuple, consts: dict, **options):
        """kernel[grid](*args, **consts, **options), through the compiled launcher when this specialisation has
        been compiled (returns None then), else through the JIT (returns its CompiledKernel)."""
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        if device.type != "cuda":
            return runnable(self.kernel, device)[grid](*args, **consts, **options)
        key = self._key(args, consts, options, device)
        compiled = self._compiled.get(key)
        if compiled is None or launch_hooks_set():
            compiled = self.kernel[grid](*args, **consts, **options)
            if len(self._compiled) >= self.MAX_ENTRIES:
                self._compiled.clear()
            self._compiled[key] = compiled
            return compiled
        g = tuple(grid) + (1, 1)
        compiled.run(g[0], g[1], g[2], _raw_stream(device), compiled.function, compiled.packed_metadata, None, None,
                     None, *self._values(args, consts))
        self.direct_launches += 1
        return None


try:  # the raw current stream, as Triton's own launcher gets it (torch.cuda.current_stream builds an object)
    from torch._C import _cuda_getCurrentRawStream as _current_raw_stream
except ImportError:  # pragma: no cover - a torch without the binding
    def _current_raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _raw_stream(device: torch.device) -> int:
    return _current_raw_stream(device.index if device.index is not None else torch.cuda.current_device())


def launch_hooks_set() -> bool:
    """Whether a launch hook listens (a profiler): direct launches then go through the JIT, which builds the
    metadata hooks expect."""
    rt = triton.knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))


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
