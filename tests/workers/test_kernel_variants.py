"""One compiled variant per kernel and launch configuration, whatever shape the steps take.

Triton compiles a kernel anew for every combination of its integer arguments' "== 1" / "divisible by 16" and its
pointers' 16-byte alignment. Per-step values (row counts, table widths, views that start at the step's prefill
row count) made the H200 compile 107 variants in the first minute of serving, a 0.2-2 s stall each
(benchmarks/probe_compiles.py, docs/benchmarks.md). Here the engine runs a serving-like mix with the Triton
attention path forced (the interpreter on CPU) and every launch's specialisation key is computed with Triton's own
`native_specialize_impl`, honouring each kernel's `do_not_specialize` lists (kernels/_triton.py `step_jit`):
within one set of constexprs and launch options, every launch must give the same key."""
from __future__ import annotations

import importlib
import random

import pytest
import torch

from workers.request import SamplingParams

MODULES = ("kernels.attention", "kernels.prefill_attention", "kernels.index_topk", "kernels.prefill_index",
           "kernels.paged_kv")


class KeyLog:
    """(kernel, constexprs + launch options) -> the set of runtime specialisation keys its launches had."""

    def __init__(self) -> None:
        self.keys: dict[tuple, set] = {}

    def wrap(self, real_runnable):
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend

        log = self

        def runnable(kernel, device):
            launch = real_runnable(kernel, device)
            opts = getattr(kernel, "kwargs", {})  # the interpreter keeps triton.jit's arguments here
            no_int, no_align = set(opts.get("do_not_specialize") or ()), set(opts.get("do_not_specialize_on_alignment") or ())

            class Grid:
                def __getitem__(self, grid):
                    def call(*args, **kwargs):
                        key = tuple(native_specialize_impl(BaseBackend, a, False, n not in no_int, n not in no_align)
                                    for n, a in zip(kernel.arg_names, args))
                        config = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
                        log.keys.setdefault((kernel.__name__, config), set()).add(key)
                        return launch[grid](*args, **kwargs)
                    return call
            return Grid()
        return runnable


@pytest.fixture
def key_log(monkeypatch):
    log = KeyLog()
    for name in MODULES:
        mod = importlib.import_module(name)
        monkeypatch.setattr(mod, "runnable", log.wrap(mod.runnable))
    return log


def test_each_kernel_compiles_once_per_launch_configuration(make_llm, key_log):
    rng = random.Random(3)
    llm = make_llm(num_pages=160, max_num_batched_tokens=48, max_num_seqs=8, attention_backend="triton")
    # waves of prompts of odd and even, page-crossing lengths, so steps mix 1-8 decode rows with prompt chunks that
    # start anywhere: the decode rows' views (positions[npf:], row_seq[npf:]) start at every alignment
    for lengths in ((3, 17, 40), (65, 2, 9, 30, 1)):
        batch = [{"prompt_token_ids": [rng.randrange(3, 384) for _ in range(n)]} for n in lengths]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(2, 7)) for _ in lengths]
        llm.generate(batch, params)
    launched = {k for k, _ in key_log.keys}
    assert {"_prefill_attn_kernel", "_decode_attn_kernel", "_prefill_index_kernel", "_index_scores_kernel"} <= launched
    many = {k: v for k, v in key_log.keys.items() if len(v) > 1}
    assert not many, "kernels that would compile again mid-serving: " + "; ".join(
        f"{name}: {len(v)} keys, differing at " + ", ".join(
            n for n, parts in zip(_names(name), zip(*v)) if len(set(parts)) > 1)
        for (name, _), v in many.items())


def _names(kernel_name: str) -> list[str]:
    for name in MODULES:
        k = getattr(importlib.import_module(name), kernel_name, None)
        if k is not None:
            return k.arg_names
    return []


def test_pointer_views_at_odd_offsets_are_what_the_check_sees():
    """The check can fail: a view one int32 past an aligned start gets another key unless the kernel opts out."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    x = torch.zeros(8, dtype=torch.int32)
    assert native_specialize_impl(BaseBackend, x, False, True, True) != native_specialize_impl(
        BaseBackend, x[1:], False, True, True)
    assert native_specialize_impl(BaseBackend, x, False, True, False) == native_specialize_impl(
        BaseBackend, x[1:], False, True, False)
