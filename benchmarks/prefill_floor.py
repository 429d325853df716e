"""PERF.md's floors of a prefill run, pure arithmetic on the model config (benchmarks/bench_engine_prefill.py):
FLOPs at 790 TFLOP/s and weight bytes at 4.3 TB/s per engine step, from the chunks each step ran.

  flop  2 x active parameters per token (embedding excluded; attention, index and MLP projections, shared expert,
        top-k routed experts, routers) + 2 x lm_head per logits row + attention per layer and chunk of T tokens
        after `start` cached: dense 4 T H D (start + T/2), sparse 4 T H D min(start + T, topk * block) + the
        indexer's scores 2 T Hi Di (start + T/2) per sparse layer.
  bytes every weight the step touches, once per step: non-expert weights (lm_head only on a step with logits
        rows, the embedding's gathered rows) + the routed experts touched (uniform-routing expectation).
  floor = sum over steps of max(flop time, byte time).
"""
from __future__ import annotations

PEAK_FLOPS = 790e12  # PERF.md: dense bf16 matmul on the lent H200
HBM_BPS = 4.3e12  # PERF.md: device-to-device copy


def active_params(cfg) -> dict[str, int]:
    """Parameters one token multiplies by, per part (every layer summed). `lm_head` is per logits row, not per
    token; `routed_all` (every routed expert's weights) is for the bytes floor, not the FLOP count."""
    h, d = cfg.hidden_size, cfg.head_dim
    n_layers = cfg.num_hidden_layers
    sparse = len(cfg.sparse_layers)
    moe = len(cfg.moe_layers)
    dense = n_layers - moe
    swiglu = 3 * h  # gate + up + down, per intermediate unit
    return {
        "attn_proj": n_layers * h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads),
        "index_proj": sparse * h * cfg.index_head_dim * (cfg.index_n_heads + 1),  # index q heads + one index k
        "dense_mlp": dense * swiglu * cfg.dense_intermediate_size,
        "shared_expert": moe * cfg.n_shared_experts * swiglu * cfg.shared_intermediate_size,
        "routed_active": moe * cfg.num_experts_per_tok * swiglu * cfg.intermediate_size,
        "router": moe * cfg.num_local_experts * h,
        "lm_head": cfg.vocab_size * h,
        "routed_all": moe * cfg.num_local_experts * swiglu * cfg.intermediate_size,
    }


PER_TOKEN_PARTS = ("attn_proj", "index_proj", "dense_mlp", "shared_expert", "routed_active", "router")


def params_per_token(cfg) -> int:
    p = active_params(cfg)
    return sum(p[k] for k in PER_TOKEN_PARTS)


def sparse_span(cfg) -> int:
    """Keys a sparse-layer query attends at most: top-k blocks of block_size tokens."""
    return cfg.index_topk_blocks * cfg.index_block_size


def chunk_flops(cfg, start: int, n: int, logits: bool) -> dict[str, float]:
    """FLOPs of one chunk of n new tokens at positions start..start+n-1 (start tokens already cached)."""
    h_d = cfg.num_attention_heads * cfg.head_dim
    sparse = len(cfg.sparse_layers)
    dense_layers = cfg.num_hidden_layers - sparse
    causal = start + n / 2  # mean keys per query, causal
    return {
        "params": 2.0 * params_per_token(cfg) * n,
        "lm_head": 2.0 * active_params(cfg)["lm_head"] if logits else 0.0,
        "attn_dense": dense_layers * 4.0 * n * h_d * causal,
        "attn_sparse": sparse * 4.0 * n * h_d * min(start + n, sparse_span(cfg)),
        "index": sparse * 2.0 * n * cfg.index_n_heads * cfg.index_head_dim * causal,
    }


def experts_touched(cfg, tokens: int) -> float:
    """Expected routed experts one MoE layer touches for `tokens` tokens at uniform routing."""
    e, k = cfg.num_local_experts, cfg.num_experts_per_tok
    return e * (1.0 - (1.0 - k / e) ** tokens) if tokens > 0 else 0.0


def step_bytes(cfg, tokens: int, logits_rows: int, dtype_bytes: int) -> dict[str, float]:
    """Weight bytes one step of `tokens` tokens must read (each weight once; routers are fp32)."""
    p = active_params(cfg)
    moe = len(cfg.moe_layers)
    per_expert = 3 * cfg.hidden_size * cfg.intermediate_size * dtype_bytes
    return {
        "non_expert": float((p["attn_proj"] + p["index_proj"] + p["dense_mlp"] + p["shared_expert"]) * dtype_bytes
                            + (p["router"] + moe * cfg.num_local_experts) * 4),  # router weight + score bias
        "lm_head": float(p["lm_head"] * dtype_bytes) if logits_rows else 0.0,
        "embedding_rows": float(tokens * cfg.hidden_size * dtype_bytes),
        "routed_experts": moe * experts_touched(cfg, tokens) * per_expert,
    }


def floor_of_steps(cfg, steps: list[list[tuple[int, int, bool]]], dtype_bytes: int) -> dict:
    """Floors of a run: `steps` = per engine step its chunks (start, num_tokens, has logits row). Per step
    max(flop time, byte time), summed; the parts summed separately beside it (ms)."""
    flop_ms = byte_ms = floor = 0.0
    flops: dict[str, float] = {}
    nbytes: dict[str, float] = {}
    for chunks in steps:
        f = {}
        for start, n, logits in chunks:
            for k, v in chunk_flops(cfg, start, n, logits).items():
                f[k] = f.get(k, 0.0) + v
        b = step_bytes(cfg, sum(n for _, n, _ in chunks), sum(1 for *_, lg in chunks if lg), dtype_bytes)
        tf, tb = sum(f.values()) / PEAK_FLOPS * 1e3, sum(b.values()) / HBM_BPS * 1e3
        flop_ms, byte_ms, floor = flop_ms + tf, byte_ms + tb, floor + max(tf, tb)
        for k, v in f.items():
            flops[k] = flops.get(k, 0.0) + v
        for k, v in b.items():
            nbytes[k] = nbytes.get(k, 0.0) + v
    return {"floor_ms": floor, "flop_ms": flop_ms, "byte_ms": byte_ms, "steps": len(steps),
            "tflop": {k: v / 1e12 for k, v in flops.items()}, "gbytes": {k: v / 1e9 for k, v in nbytes.items()}}


def planned_steps(length: int, chunk: int) -> list[list[tuple[int, int, bool]]]:
    """How the scheduler chunks one prompt alone in the engine (chunk tokens per step, the last one sampled)."""
    return [[(s, min(chunk, length - s), s + chunk >= length)] for s in range(0, length, chunk)]


def model_param_counts(model) -> dict[str, int]:
    """The same parts counted from the built model's parameters (a check of `active_params`): 3-D parameters are
    the routed experts [E, rows, cols]; every other matrix but the embedding and the LM head runs per token."""
    out = {"per_token": 0, "routed_all": 0, "lm_head": 0}
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        if name.startswith("lm_head"):
            out["lm_head"] += p.numel()
        elif p.dim() == 3:
            out["routed_all"] += p.numel()
            out["per_token"] += p.numel() // p.shape[0] * model.config.num_experts_per_tok
        else:
            out["per_token"] += p.numel()
    return out
