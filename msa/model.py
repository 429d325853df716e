"""The MiniMax-M3 text model over the paged KV cache, and `load_model`.

forward(input_ids [T], meta, kv) runs one step over a flat batch of prefill chunks and decode rows and returns
the final-normed hidden states [T, H]; compute_logits(hidden[meta.logits_indices]) -> fp32 logits [N, vocab].
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from msa.attention import M3Attention
from msa.config import M3Config, load_config
from msa.kv_cache import KVCache
from msa.layers import RMSNorm, RotaryEmbedding
from msa.linear import ParallelLMHead, VocabParallelEmbedding
from msa.metadata import AttentionMetadata
from msa.moe import DenseMLP, SparseMoE
from msa.parallel import ParallelContext


class DecoderLayer(nn.Module):
    def __init__(self, config: M3Config, layer_idx: int, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.self_attn = M3Attention(config, layer_idx, ctx, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)
        self.mlp = (SparseMoE(config, ctx, dtype=dtype, device=device) if config.is_moe(layer_idx)
                    else DenseMLP(config, config.dense_intermediate_size, ctx, dtype=dtype, device=device))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos, sin, meta: AttentionMetadata,
                kv: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            x, residual = self.input_layernorm(h, residual)
        x = self.self_attn(x, cos, sin, meta, kv)
        x, residual = self.post_attention_layernorm(x, residual)
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(x, meta.moe_group_tokens), residual
        return self.mlp(x), residual


class M3Model(nn.Module):
    def __init__(self, config: M3Config, ctx: ParallelContext, *, dtype, device):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, ctx, dtype=dtype,
                                                   device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, i, ctx, dtype=dtype, device=device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, device=device)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        cos, sin = self.rotary.cos_sin(meta.positions)
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, cos, sin, meta, kv)
        return self.norm(h, residual)[0] if residual is not None else self.norm(h)


class M3ForCausalLM(nn.Module):
    """One shard of MiniMax-M3 (text tower). Parameters are created uninitialised; `load_weights` fills them."""

    def __init__(self, config: M3Config, *, ctx: ParallelContext | None = None, dtype=torch.float32,
                 device="cpu"):
        super().__init__()
        self.config = config
        self.ctx = ctx or ParallelContext.single()
        self.dtype = dtype
        self.model = M3Model(config, self.ctx, dtype=dtype, device=device)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.ctx, dtype=dtype, device=device)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """input_ids [T] int64 -> final-normed hidden states [T, H]. Writes this step's K/V/index-K into `kv`."""
        if input_ids.shape != meta.positions.shape:
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)} does not match the metadata's "
                             f"{meta.num_tokens} tokens")
        return self.model(input_ids, meta, kv)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> fp32 logits [N, vocab] (gathered over tp)."""
        return self.lm_head(hidden).float()

    def set_attention_backend(self, backend: str | None) -> None:
        """Attention and indexer kernels of every layer: None = Triton on CUDA, the torch references elsewhere;
        "triton" / "ref" force one."""
        if backend not in (None, "triton", "ref"):
            raise ValueError(f"attention backend must be None, 'triton' or 'ref', got {backend!r}")
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def load_weights(self, model_dir: str | Path) -> None:
        from msa.weights import load_weights

        load_weights(self, model_dir)


def load_model(model_dir: str | Path, *, device="cpu", dtype=torch.float32,
               ctx: ParallelContext | None = None) -> M3ForCausalLM:
    """Parse `config.json`, build this shard's model on `device`, and stream its weight slices from the
    checkpoint (both layouts; see msa/weights.py)."""
    config = load_config(model_dir)
    model = M3ForCausalLM(config, ctx=ctx, dtype=dtype, device=device)
    model.load_weights(model_dir)
    return model.eval()


__all__ = ["M3ForCausalLM", "M3Model", "DecoderLayer", "load_model"]
