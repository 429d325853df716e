"""MiniMax-M3 text-model configuration, parsed from every `config.json` form users meet (M3_SPEC.md §1).

`M3Config` is the one source of truth for shapes inside `msa/` and `kernels/`. It is never written by hand for a
real checkpoint: `load_config(model_dir)` parses the checkpoint's `config.json`. The YAML model presets in
`configs/models/` hold the same fields and are only used to *write* random checkpoints.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL_ATTENTION = "full_attention"
SPARSE_ATTENTION = "minimax_m3_sparse"
DENSE_MLP = "dense"
MOE_MLP = "sparse"


@dataclass(frozen=True, kw_only=True)
class M3Config:
    """Shapes and constants of the MiniMax-M3 text tower. Names follow transformers' `MiniMaxM3VLTextConfig`."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float = 5e6
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1048576
    intermediate_size: int
    shared_intermediate_size: int
    dense_intermediate_size: int
    num_local_experts: int
    num_experts_per_tok: int
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    index_n_heads: int
    index_head_dim: int
    index_block_size: int
    index_topk_blocks: int
    index_local_blocks: int = 1
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.layer_types) != n:
            raise ValueError(f"layer_types: has {len(self.layer_types)} entries for {n} layers")
        if len(self.mlp_layer_types) != n:
            raise ValueError(f"mlp_layer_types: has {len(self.mlp_layer_types)} entries for {n} layers")
        for t in self.layer_types:
            if t not in (FULL_ATTENTION, SPARSE_ATTENTION):
                raise ValueError(f"layer_types: unknown attention type {t!r}")
        for t in self.mlp_layer_types:
            if t not in (DENSE_MLP, MOE_MLP):
                raise ValueError(f"mlp_layer_types: unknown MLP type {t!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads: must be a multiple of num_key_value_heads")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(f"rotary_dim: must be even and in (0, head_dim], got {self.rotary_dim}")
        if self.rotary_dim > self.index_head_dim:
            raise ValueError("rotary_dim: must not exceed index_head_dim (the indexer shares the partial RoPE)")
        if any(t == SPARSE_ATTENTION for t in self.layer_types) and self.index_n_heads != self.num_key_value_heads:
            raise ValueError("index_n_heads: must equal num_key_value_heads (one selection per KV group)")
        bs = self.index_block_size
        if bs < 16 or bs & (bs - 1):
            raise ValueError(f"index_block_size: must be a power of two >= 16 (it is the KV page size), got {bs}")
        if self.num_experts_per_tok > self.num_local_experts:
            raise ValueError("num_experts_per_tok: exceeds num_local_experts")
        if self.n_shared_experts not in (0, 1):
            raise ValueError(f"n_shared_experts: only 0 or 1 is supported, got {self.n_shared_experts}")

    # Derived views used by the model and the engine.
    @property
    def page_size(self) -> int:
        """KV page size: equal to the sparse block size (DESIGN.md §4)."""
        return self.index_block_size

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == SPARSE_ATTENTION)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == MOE_MLP)

    def is_sparse(self, layer: int) -> bool:
        return self.layer_types[layer] == SPARSE_ATTENTION

    def is_moe(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == MOE_MLP

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K, V (all layers) and index-K (sparse layers) one token occupies, unsharded."""
        main = self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim
        index = len(self.sparse_layers) * self.index_head_dim
        return (main + index) * dtype_bytes

    def to_hf_text_dict(self) -> dict[str, Any]:
        """The transformers-native flat text config (what `MiniMaxM3VLTextConfig` reads)."""
        return {
            "model_type": "minimax_m3_vl_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rotary_dim": self.rotary_dim,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.rotary_dim / self.head_dim,
            },
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "intermediate_size": self.intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "num_local_experts": self.num_local_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_block_size": self.index_block_size,
            "index_topk_blocks": self.index_topk_blocks,
            "index_local_blocks": self.index_local_blocks,
            "layer_types": list(self.layer_types),
            "mlp_layer_types": list(self.mlp_layer_types),
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if len(self.eos_token_id) != 1 else self.eos_token_id[0],
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
        }

    def to_hub_dict(self) -> dict[str, Any]:
        """The original hub `config.json`: `minimax_m3_vl` wrapper, legacy sparse keys, `moe_layer_freq`."""
        text = self.to_hf_text_dict()
        for k in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks",
                  "index_local_blocks", "layer_types", "mlp_layer_types", "rope_parameters"):
            text.pop(k)
        text.update({
            "model_type": "minimax_m3_vl_text",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "hidden_act": "swigluoai",
            "n_shared_experts": self.n_shared_experts,
            "moe_layer_freq": [1 if t == MOE_MLP else 0 for t in self.mlp_layer_types],
            "sparse_attention_config": {
                "sparse_num_index_heads": self.index_n_heads,
                "sparse_index_dim": self.index_head_dim,
                "sparse_block_size": self.index_block_size,
                "sparse_topk_blocks": self.index_topk_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_init_block": 0,
                "sparse_attention_freq": [1 if t == SPARSE_ATTENTION else 0 for t in self.layer_types],
                "sparse_disable_index_value": [1 if t == SPARSE_ATTENTION else 0 for t in self.layer_types],
                "sparse_score_type": "max",
            },
        })
        return {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "text_config": text,
            "vision_config": {"model_type": "minimax_m3_vl_vision", "hidden_size": 64, "num_hidden_layers": 1},
            "image_token_index": 200025,
            "projector_hidden_size": self.hidden_size,
            "tie_word_embeddings": False,
        }


class UnsupportedConfig(ValueError):
    """The checkpoint asks for a variant this project does not implement; the message names the field."""


def load_config(model_dir: str | Path) -> M3Config:
    """Parse `<model_dir>/config.json` (any supported form) into an `M3Config`."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no config.json in the model directory")
    return parse_config(json.loads(path.read_text()), source=str(path))


def parse_config(raw: dict[str, Any], source: str = "config.json") -> M3Config:
    """Accept the hub wrapper, a text-only config, legacy sparse keys and transformers-native flat keys."""
    model_type = raw.get("model_type")
    if model_type == "minimax_m3_vl" or "text_config" in raw:
        text = dict(raw.get("text_config") or {})
        quant = raw.get("quantization_config") or text.get("quantization_config")
        # the wrapper often carries the checkpoint's dtype at the top level only: a float32 checkpoint read as
        # bf16 ran off the reference by 0.01-0.05 in logprobs without a word
        for key in ("torch_dtype", "dtype"):
            if not (text.get("torch_dtype") or text.get("dtype")) and raw.get(key):
                text[key] = raw[key]
    elif model_type in ("minimax_m3_vl_text", None):
        text = dict(raw)
        quant = raw.get("quantization_config")
    else:
        raise UnsupportedConfig(f"{source}: model_type: {model_type!r} is not MiniMax-M3 (minimax_m3_vl)")
    if quant:
        method = quant.get("quant_method", quant) if isinstance(quant, dict) else quant
        raise UnsupportedConfig(f"{source}: quantization_config: {method!r} is not supported yet (bf16/fp32 only)")
    return _parse_text(text, source)


def _dtype_name(value: Any, source: str) -> str:
    """'bfloat16' | 'float16' | 'float32' from a config's dtype (transformers writes "bfloat16", some tools
    "torch.bfloat16")."""
    name = str(value).removeprefix("torch.")
    name = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name)
    if name not in ("bfloat16", "float16", "float32"):
        raise UnsupportedConfig(f"{source}: torch_dtype: {value!r} is not one of bfloat16, float16, float32")
    return name


def _need(d: dict[str, Any], key: str, source: str) -> Any:
    if key not in d:
        raise UnsupportedConfig(f"{source}: {key}: required field is missing")
    return d[key]


def _parse_text(t: dict[str, Any], source: str) -> M3Config:
    n = int(_need(t, "num_hidden_layers", source))
    heads = int(_need(t, "num_attention_heads", source))
    hidden = int(_need(t, "hidden_size", source))
    head_dim = int(t.get("head_dim") or hidden // heads)
    sparse = t.get("sparse_attention_config") or {}

    # RoPE: rope_parameters (native) or top-level rope_theta / partial_rotary_factor / rotary_dim (hub).
    rope = dict(t.get("rope_parameters") or t.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise UnsupportedConfig(f"{source}: rope_parameters.rope_type: {rope_type!r} scaling is not supported")
    if t.get("rope_scaling"):
        raise UnsupportedConfig(f"{source}: rope_scaling: RoPE scaling is not supported")
    theta = float(rope.get("rope_theta", t.get("rope_theta", 5e6)))
    prf = rope.get("partial_rotary_factor", t.get("partial_rotary_factor"))
    rotary_dim = int(t["rotary_dim"]) if t.get("rotary_dim") else None
    if prf is not None and rotary_dim is not None and int(head_dim * float(prf)) != rotary_dim:
        raise UnsupportedConfig(f"{source}: rotary_dim: {rotary_dim} disagrees with partial_rotary_factor {prf}")
    if rotary_dim is None:
        rotary_dim = int(head_dim * float(prf)) if prf is not None else head_dim

    def pick(native: str, legacy: str, default: Any = None) -> Any:
        if native in t:
            return t[native]
        if legacy in sparse:
            return sparse[legacy]
        if default is None:
            raise UnsupportedConfig(f"{source}: {native}: required field is missing")
        return default

    if sparse.get("sparse_init_block", 0):
        raise UnsupportedConfig(f"{source}: sparse_attention_config.sparse_init_block: init blocks > 0 not supported")
    score = sparse.get("sparse_score_type", "max")
    if score != "max":
        raise UnsupportedConfig(f"{source}: sparse_attention_config.sparse_score_type: {score!r} (only 'max')")
    for gate_key in ("use_output_gate", "attn_output_gate", "attention_output_gate"):
        if t.get(gate_key):
            raise UnsupportedConfig(f"{source}: {gate_key}: attention output gate is not supported")
    disable_iv = sparse.get("sparse_disable_index_value")
    if disable_iv is not None:
        flags = disable_iv if isinstance(disable_iv, list) else [disable_iv]
        sparse_freq = sparse.get("sparse_attention_freq") or [1] * len(flags)
        if any(f == 0 and s for f, s in zip(flags, sparse_freq)):
            raise UnsupportedConfig(f"{source}: sparse_attention_config.sparse_disable_index_value: "
                                    "an index-value branch is not supported")

    layer_types = t.get("layer_types")
    if layer_types is None:
        freq = sparse.get("sparse_attention_freq")
        layer_types = [SPARSE_ATTENTION if f else FULL_ATTENTION for f in freq] if freq else [FULL_ATTENTION] * n
    mlp_types = t.get("mlp_layer_types")
    if mlp_types is None:
        freq = t.get("moe_layer_freq")
        mlp_types = [MOE_MLP if f else DENSE_MLP for f in freq] if freq is not None else [MOE_MLP] * n

    eos = t.get("eos_token_id")
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    try:
        return M3Config(
            vocab_size=int(_need(t, "vocab_size", source)),
            hidden_size=hidden,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=int(t.get("num_key_value_heads", heads)),
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=theta,
            rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(t.get("max_position_embeddings", 1048576)),
            intermediate_size=int(_need(t, "intermediate_size", source)),
            shared_intermediate_size=int(t.get("shared_intermediate_size", t["intermediate_size"])),
            dense_intermediate_size=int(t.get("dense_intermediate_size", t["intermediate_size"])),
            num_local_experts=int(t.get("num_local_experts", t.get("num_experts", 1))),
            num_experts_per_tok=int(t.get("num_experts_per_tok", 1)),
            n_shared_experts=int(t.get("n_shared_experts", 1)),
            routed_scaling_factor=float(t.get("routed_scaling_factor", 1.0)),
            swiglu_alpha=float(t.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(t.get("swiglu_limit", 7.0)),
            index_n_heads=int(pick("index_n_heads", "sparse_num_index_heads", 4)),
            index_head_dim=int(pick("index_head_dim", "sparse_index_dim", 128)),
            index_block_size=int(pick("index_block_size", "sparse_block_size", 128)),
            index_topk_blocks=int(pick("index_topk_blocks", "sparse_topk_blocks", 16)),
            index_local_blocks=int(pick("index_local_blocks", "sparse_local_block", 1)),
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            bos_token_id=t.get("bos_token_id"),
            eos_token_id=eos_ids,
            torch_dtype=_dtype_name(t.get("torch_dtype") or t.get("dtype") or "bfloat16", source),
        )
    except ValueError as e:
        raise UnsupportedConfig(f"{source}: {e}") from None


__all__ = ["M3Config", "UnsupportedConfig", "load_config", "parse_config",
           "FULL_ATTENTION", "SPARSE_ATTENTION", "DENSE_MLP", "MOE_MLP"]
