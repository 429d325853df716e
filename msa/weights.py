"""Stream a sharded safetensors checkpoint into one shard's parameters, in either layout users have.

Layouts (M3_SPEC.md §2):
  "hub": keys prefixed `language_model.`; per-expert `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down),
         `block_sparse_moe.gate`, `block_sparse_moe.e_score_correction_bias`, `self_attn.index_*`, separate
         gate/up projections.
  "transformers": what `MiniMaxM3VLForCausalLM.save_pretrained` writes (optionally under `model.language_model.`
         when saved from the VL wrapper): packed `mlp.experts.gate_up_proj` [E, 2I, H], `mlp.gate.*`,
         `self_attn.indexer.*`, packed `gate_up_proj.weight`.
The plan maps every checkpoint key this model needs to (parameter, shard id); tensors are read one at a time
through `get_slice`, and each parameter's `weight_loader` reads only this rank's slice. Vision, projector and MTP
keys are skipped; anything else unknown, anything missing, and any shape mismatch is an error naming the key.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from torch import nn

from msa.linear import WeightShapeError

HUB_PREFIX = "language_model."
VL_PREFIX = "model.language_model."
_SKIP = re.compile(r"^(language_model\.|model\.)?(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")


class WeightLoadError(ValueError):
    """The checkpoint does not fit the model; the message names the offending key(s)."""


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when there is one."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        files = sorted({d / f for f in weight_map.values()})
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise WeightLoadError(f"{index}: lists shard files that do not exist: {absent}")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{d}: no *.safetensors files and no model.safetensors.index.json")
    return files


def _param_keys(name: str, param: nn.Parameter, num_experts: int, layout: str) -> list[tuple[str, Any]]:
    """The checkpoint keys (and shard ids) that fill parameter `name` in `layout` (unprefixed for hub)."""
    m = re.fullmatch(r"(.*\.self_attn\.)qkv_proj\.weight", name)
    if m:
        return [(f"{m[1]}{p}_proj.weight", p) for p in ("q", "k", "v")]
    if layout == "transformers":
        return [(name, None)]
    rules = [
        (r"(.*\.self_attn\.)indexer\.(q_proj|k_proj|q_norm|k_norm)\.weight", lambda m: [(f"{m[1]}index_{m[2]}.weight", None)]),
        (r"(.*\.)mlp\.gate_up_proj\.weight", lambda m: [(f"{m[1]}mlp.gate_proj.weight", 0),
                                                        (f"{m[1]}mlp.up_proj.weight", 1)]),
        (r"(.*\.)mlp\.gate\.weight", lambda m: [(f"{m[1]}block_sparse_moe.gate.weight", None)]),
        (r"(.*\.)mlp\.gate\.e_score_correction_bias",
         lambda m: [(f"{m[1]}block_sparse_moe.e_score_correction_bias", None)]),
        (r"(.*\.)mlp\.experts\.gate_up_proj",
         lambda m: [(f"{m[1]}block_sparse_moe.experts.{e}.{w}.weight", (e, part))
                    for e in range(num_experts) for w, part in (("w1", "gate"), ("w3", "up"))]),
        (r"(.*\.)mlp\.experts\.down_proj",
         lambda m: [(f"{m[1]}block_sparse_moe.experts.{e}.w2.weight", e) for e in range(num_experts)]),
        (r"(.*\.)mlp\.shared_experts\.gate_up_proj\.weight",
         lambda m: [(f"{m[1]}block_sparse_moe.shared_experts.gate_proj.weight", 0),
                    (f"{m[1]}block_sparse_moe.shared_experts.up_proj.weight", 1)]),
        (r"(.*\.)mlp\.shared_experts\.down_proj\.weight",
         lambda m: [(f"{m[1]}block_sparse_moe.shared_experts.down_proj.weight", None)]),
    ]
    for pattern, keys in rules:
        m = re.fullmatch(pattern, name)
        if m:
            return keys(m)
    return [(name, None)]


def load_plan(model: nn.Module, layout: str) -> dict[str, tuple[str, Any]]:
    """{checkpoint key (without the layout's prefix): (parameter name, shard id)} for every key `model` needs."""
    if layout not in ("hub", "transformers"):
        raise ValueError(f"layout: {layout!r} is not 'hub' or 'transformers'")
    num_experts = model.config.num_local_experts
    plan: dict[str, tuple[str, Any]] = {}
    for name, param in model.named_parameters():
        for key, shard in _param_keys(name, param, num_experts, layout):
            plan[key] = (name, shard)
    return plan


def expected_keys(model: nn.Module, layout: str) -> set[str]:
    """The full checkpoint key set (with the layout's prefix) a text-only checkpoint for `model` holds."""
    prefix = HUB_PREFIX if layout == "hub" else ""
    return {prefix + k for k in load_plan(model, layout)}


def detect_layout(keys: list[str]) -> tuple[str, str]:
    """(layout, prefix to strip) from the checkpoint's key names."""
    if any(k.startswith(HUB_PREFIX) for k in keys):
        return "hub", HUB_PREFIX
    if any(k.startswith(VL_PREFIX) for k in keys):
        return "transformers", VL_PREFIX
    return "transformers", ""


def _normalise(key: str, prefix: str) -> str | None:
    """Checkpoint key -> plan key, or None when the key is not part of the text model's prefix."""
    if prefix == VL_PREFIX:
        if key.startswith(VL_PREFIX):
            return "model." + key[len(VL_PREFIX):]
        return key if key == "lm_head.weight" else None
    if not key.startswith(prefix):
        return None
    return key[len(prefix):]


def _denormalise(plan_key: str, prefix: str) -> str:
    """Plan key -> the key as this checkpoint would spell it (for error messages)."""
    if prefix == VL_PREFIX and plan_key.startswith("model."):
        return VL_PREFIX + plan_key[len("model."):]
    return (prefix if prefix != VL_PREFIX else "") + plan_key


def load_weights(model: nn.Module, model_dir: str | Path) -> dict[str, Any]:
    """Fill every parameter of `model` from `model_dir`; returns {"layout", "files", "tensors"} for logging."""
    from safetensors import safe_open

    files = checkpoint_files(model_dir)
    key_lists = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            key_lists[f] = list(fh.keys())
    layout, prefix = detect_layout([k for ks in key_lists.values() for k in ks])
    plan = load_plan(model, layout)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for key in key_lists[f]:
                if _SKIP.search(key):
                    continue
                plan_key = _normalise(key, prefix)
                if plan_key is None or plan_key not in plan:
                    unexpected.append(key)
                    continue
                if plan_key in loaded:
                    raise WeightLoadError(f"{f.name}: {key}: appears twice in the checkpoint")
                name, shard = plan[plan_key]
                param = params[name]
                try:
                    param.weight_loader(param, fh.get_slice(key), shard)
                except WeightShapeError as e:
                    raise WeightLoadError(f"{f.name}: {key}: {e} (parameter {name})") from None
                loaded.add(plan_key)
    if unexpected:
        raise WeightLoadError(f"{model_dir}: unexpected keys for a {layout}-layout checkpoint of this config: "
                              f"{_preview(unexpected)}")
    missing = [k for k in plan if k not in loaded]
    if missing:
        shown = [_denormalise(k, prefix) for k in missing]
        raise WeightLoadError(f"{model_dir}: missing keys in a {layout}-layout checkpoint: {_preview(shown)}")
    return {"layout": layout, "files": len(files), "tensors": len(loaded)}


def _preview(keys: list[str], n: int = 8) -> str:
    more = f" ... and {len(keys) - n} more" if len(keys) > n else ""
    return ", ".join(keys[:n]) + more


__all__ = ["WeightLoadError", "load_weights", "load_plan", "expected_keys", "detect_layout", "checkpoint_files"]
