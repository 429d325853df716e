"""transformers' MiniMax-M3 on the same weights and prompts: the reference decode step of bench_engine_decode.py.

`--hf-reference` there writes the benchmark's checkpoint in the transformers layout (the engine reads either
layout, msa/weights.py), so both load the very same file; this loads it into
`transformers.models.minimax_m3_vl.MiniMaxM3VLForCausalLM` (bf16, on the GPU), and for each batch size runs the
same B prompts as one batch: one forward over the prompts, then greedy decode steps of one token per request with
transformers' KV cache. A step is timed from its call to a device synchronise after the argmax (what a
transformers user's decode loop waits for per token); reported is the median over the steps, beside the engine's.
Hand-written (not `generate`): `generate` times prefill and decode together and adds its own logits processing.
"""
from __future__ import annotations

import gc
import statistics
import time
from pathlib import Path

import torch


def load_hf_model(path: Path, device: str, dtype: torch.dtype = torch.bfloat16):
    """-> (the model on `device`, its attention implementation: sdpa where the model takes it, else eager)."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    for attn in ("sdpa", "eager"):
        try:
            model = MiniMaxM3VLForCausalLM.from_pretrained(path, attn_implementation=attn, dtype=dtype)
            return model.to(device).eval(), attn
        except (ValueError, NotImplementedError):  # an attention implementation this model does not take
            continue
    raise RuntimeError(f"{path}: transformers could not load the model with sdpa or eager attention")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def hf_decode(model, prompts: list[list[int]], decode_tokens: int) -> dict:
    """Greedy decode of the prompts as one batch -> {"step_ms", "prefill_ms", "steps", "tokens" (per request,
    `decode_tokens` each)}; all prompts have one length (no padding). Out of device memory: {"error": ...}."""
    device = next(model.parameters()).device
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    try:
        _sync(device)
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True)
        nxt = out.logits[:, -1].argmax(-1)
        _sync(device)
        prefill_ms = 1e3 * (time.perf_counter() - t0)
        cache, tokens, times = out.past_key_values, [nxt.tolist()], []
        del out
        for _ in range(decode_tokens - 1):
            t0 = time.perf_counter()
            out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
            nxt = out.logits[:, -1].argmax(-1)
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t0))
            cache = out.past_key_values
            tokens.append(nxt.tolist())
            del out
    except torch.OutOfMemoryError as e:
        return {"error": f"CUDA out of memory ({str(e).splitlines()[0][:120]})"}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    per_request = [list(t) for t in zip(*tokens)]
    return {"step_ms": statistics.median(times) if times else None, "prefill_ms": prefill_ms, "steps": len(times),
            "tokens": per_request}


def reference_rows(ckpt_dir: Path, prompts_by_b: dict[int, list[list[int]]], decode_tokens: int, *,
                   device: str = "cuda") -> dict[int, dict]:
    """{B: hf_decode result} for every batch size, one model load; a 3-token warm-up at the first B first."""
    model, attn = load_hf_model(ckpt_dir, device)
    try:
        first = next(iter(prompts_by_b.values()))
        hf_decode(model, first[:1], 3)
        rows = {}
        for b, prompts in prompts_by_b.items():
            rows[b] = hf_decode(model, prompts, decode_tokens) | {"attn_implementation": attn}
        return rows
    finally:
        del model
        gc.collect()
        torch.cuda.empty_cache()
