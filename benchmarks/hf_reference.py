"""transformers' MiniMax-M3 on the same weights and prompts: the reference decode step of bench_engine_decode.py.

`--hf-reference` there writes the benchmark's checkpoint in the transformers layout (the engine reads either
layout, msa/weights.py), so both load the very same file; this loads it into
`transformers.models.minimax_m3_vl.MiniMaxM3VLForCausalLM` (bf16, on the GPU), and for each batch size runs the
same B prompts as one batch: one forward over the prompts, then greedy decode steps of one token per request with
transformers' KV cache. A step is timed from its call to a device synchronise after the argmax (what a
transformers user's decode loop waits for per token); reported is the median over the steps, beside the engine's.
Hand-written (not `generate`): `generate` times prefill and decode together and adds its own logits processing.

It runs in a process of its own, before the engine starts (`run_in_subprocess`): timed in the benchmark's process
after the engine, the same model took 90-104 ms a step against 16.6-17.3 ms alone (docs/benchmarks.md D5).
  python benchmarks/hf_reference.py --ckpt-dir DIR --prompts prompts.json --decode-tokens 48 --out hf.json
(prompts.json: {"B": [[ids...], ...], ...}; hf.json: {"B": hf_decode's result, ...}).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
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
                   device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict[int, dict]:
    """{B: hf_decode result} for every batch size, one model load; a 3-token warm-up at the first B first."""
    model, attn = load_hf_model(ckpt_dir, device, dtype)
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


def run_in_subprocess(ckpt_dir: Path, prompts_by_b: dict[int, list[list[int]]], decode_tokens: int, *,
                      device: str = "cuda", dtype: str = "bfloat16", timeout_s: float = 600.0) -> dict[int, dict]:
    """`reference_rows` in a fresh Python process (nothing of the caller's allocator, threads or kernels around)."""
    with tempfile.TemporaryDirectory(prefix="hf-reference-") as tmp:
        prompts, out = Path(tmp) / "prompts.json", Path(tmp) / "hf.json"
        prompts.write_text(json.dumps({str(b): p for b, p in prompts_by_b.items()}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--ckpt-dir", str(ckpt_dir), "--prompts", str(prompts),
               "--decode-tokens", str(decode_tokens), "--device", device, "--dtype", dtype, "--out", str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"hf_reference.py exited {proc.returncode}: {proc.stderr[-2000:]}")
        return {int(b): row for b, row in json.loads(out.read_text()).items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--prompts", required=True, help='JSON {"B": [[token ids], ...]}')
    p.add_argument("--decode-tokens", type=int, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--out", required=True, help="result JSON")
    args = p.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    prompts = {int(b): v for b, v in json.loads(Path(args.prompts).read_text()).items()}
    rows = reference_rows(Path(args.ckpt_dir), prompts, args.decode_tokens, device=args.device,
                          dtype=getattr(torch, args.dtype))
    Path(args.out).write_text(json.dumps({str(b): r for b, r in rows.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
