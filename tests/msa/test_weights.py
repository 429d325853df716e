"""Weight loading: both layouts give the same model, the key plan matches what each layout holds, every rank
reads only its slices, and a bad checkpoint fails with a message naming the key."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from msa.config import UnsupportedConfig, load_config
from msa.model import M3ForCausalLM, load_model
from msa.parallel import ParallelContext
from msa.weights import WeightLoadError, expected_keys

SEED = 7


def _all_keys(d) -> set[str]:
    return set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])


def test_both_layouts_load_the_same_weights(ckpts, tiny_cfg):
    hub = ckpts.model(tiny_cfg, SEED, "hub").state_dict()
    tf = ckpts.model(tiny_cfg, SEED, "transformers").state_dict()
    assert hub.keys() == tf.keys()
    for k in hub:
        assert torch.equal(hub[k], tf[k]), k


def test_key_plan_matches_each_layout(ckpts, tiny_cfg):
    model = M3ForCausalLM(tiny_cfg)
    ref_keys = set(ckpts.reference(tiny_cfg, SEED).state_dict())
    assert expected_keys(model, "transformers") == ref_keys
    hub_keys = _all_keys(ckpts.path(tiny_cfg, SEED, "hub"))
    skipped = {k for k in hub_keys if not k.startswith("language_model.") or ".mtp." in k}
    assert skipped, "the hub checkpoint should carry vision/projector/mtp keys the loader skips"
    assert expected_keys(model, "hub") == hub_keys - skipped


def _copy(ckpts, cfg, layout, tmp_path):
    dst = tmp_path / layout
    shutil.copytree(ckpts.path(cfg, SEED, layout), dst)
    return dst


def _edit_tensor(d, key, fn):
    """Apply fn(dict of the shard's tensors) to the shard holding `key`, keeping the index in sync."""
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = d / index["weight_map"][key]
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard)
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k != key or key in tensors}
    index["weight_map"].update({k: shard.name for k in tensors})
    index_path.write_text(json.dumps(index))


def test_missing_key_is_named(ckpts, tiny_cfg, tmp_path):
    d = _copy(ckpts, tiny_cfg, "hub", tmp_path)
    key = "language_model.model.layers.2.block_sparse_moe.experts.5.w3.weight"
    _edit_tensor(d, key, lambda t: t.pop(key))
    with pytest.raises(WeightLoadError, match=r"missing keys.*layers\.2\.block_sparse_moe\.experts\.5\.w3\.weight"):
        load_model(d)


def test_unexpected_key_is_named(ckpts, tiny_cfg, tmp_path):
    d = _copy(ckpts, tiny_cfg, "transformers", tmp_path)
    key = "model.layers.0.self_attn.q_norm.weight"
    _edit_tensor(d, key, lambda t: t.__setitem__("model.layers.0.self_attn.o_gate.weight", torch.zeros(3)))
    with pytest.raises(WeightLoadError, match=r"unexpected keys.*model\.layers\.0\.self_attn\.o_gate\.weight"):
        load_model(d)


@pytest.mark.parametrize("layout,key", [
    ("hub", "language_model.model.layers.1.self_attn.index_q_proj.weight"),
    ("transformers", "model.layers.3.mlp.experts.gate_up_proj"),
])
def test_wrong_shape_is_named(ckpts, tiny_cfg, tmp_path, layout, key):
    d = _copy(ckpts, tiny_cfg, layout, tmp_path)
    _edit_tensor(d, key, lambda t: t.__setitem__(key, t[key][..., :-1].contiguous()))
    with pytest.raises(WeightLoadError, match=rf"{key.replace('.', '[.]')}: shape .* does not match the expected"):
        load_model(d)


@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_quantized_checkpoint_is_refused(ckpts, tiny_cfg, tmp_path, layout):
    d = _copy(ckpts, tiny_cfg, layout, tmp_path)
    raw = json.loads((d / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedConfig, match="quantization_config.*fp8"):
        load_model(d)


def _ctx(tp=1, tp_rank=0, ep=1, ep_rank=0):
    # loading runs no collective; a placeholder group object satisfies the context's check
    return ParallelContext(tp_size=tp, tp_rank=tp_rank, tp_group=object() if tp > 1 else None,
                           ep_size=ep, ep_rank=ep_rank, ep_group=object() if ep > 1 else None)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_ranks_load_exactly_their_slices(ckpts, tiny_cfg, tp):
    """tp=2 splits the 2 KV heads; tp=4 replicates each KV head on two ranks. Concatenating the ranks' slices
    gives back the single-shard weights, and each rank holds 1/tp of every sharded matrix."""
    cfg, d = tiny_cfg, ckpts.path(tiny_cfg, SEED, "hub")
    full = load_model(d).state_dict()
    ranks = [load_model(d, ctx=_ctx(tp, r)).state_dict() for r in range(tp)]
    hd, hkv, hq = cfg.head_dim, cfg.num_key_value_heads, cfg.num_attention_heads
    qkv = full["model.layers.1.self_attn.qkv_proj.weight"]
    q, k, v = qkv.split([hq * hd, hkv * hd, hkv * hd])
    local = [r["model.layers.1.self_attn.qkv_proj.weight"] for r in ranks]
    nq = hq * hd // tp
    assert torch.equal(torch.cat([x[:nq] for x in local]), q)
    kv_per = max(1, hkv // tp) * hd
    for r, x in enumerate(local):
        head = r * hkv // tp  # the KV head of this rank's q heads
        assert torch.equal(x[nq:nq + kv_per], k[head * hd:head * hd + kv_per])
        assert torch.equal(x[nq + kv_per:], v[head * hd:head * hd + kv_per])
    idx_q = [r["model.layers.1.self_attn.indexer.q_proj.weight"] for r in ranks]
    di = cfg.index_head_dim
    for r, x in enumerate(idx_q):
        head = r * hkv // tp
        assert torch.equal(x, full["model.layers.1.self_attn.indexer.q_proj.weight"][head * di:(head + 1) * di * max(1, hkv // tp)])
    for name, dim in [("model.layers.1.self_attn.o_proj.weight", 1), ("model.layers.0.mlp.down_proj.weight", 1),
                      ("model.layers.2.mlp.experts.down_proj", 2), ("model.embed_tokens.weight", 0),
                      ("lm_head.weight", 0)]:
        assert torch.equal(torch.cat([r[name] for r in ranks], dim=dim), full[name]), name
    for name in ["model.layers.0.mlp.gate_up_proj.weight", "model.layers.2.mlp.shared_experts.gate_up_proj.weight",
                 "model.layers.2.mlp.experts.gate_up_proj"]:
        dim = 1 if name.endswith("mlp.experts.gate_up_proj") else 0  # [E, 2I, H] vs [2I, H]
        gate, up = full[name].chunk(2, dim=dim)
        parts = [r[name].chunk(2, dim=dim) for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts], dim=dim), gate), name
        assert torch.equal(torch.cat([p[1] for p in parts], dim=dim), up), name
    for name in ["model.layers.1.self_attn.indexer.k_proj.weight", "model.layers.2.mlp.gate.weight",
                 "model.layers.2.mlp.gate.e_score_correction_bias", "model.norm.weight"]:
        assert all(torch.equal(r[name], full[name]) for r in ranks), f"{name} is replicated"


@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_ep_ranks_hold_their_experts(ckpts, tiny_cfg, layout):
    d = ckpts.path(tiny_cfg, SEED, layout)
    full = load_model(d).state_dict()
    ranks = [load_model(d, ctx=_ctx(ep=2, ep_rank=r)).state_dict() for r in range(2)]
    for name in ["model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"]:
        assert ranks[0][name].shape[0] == tiny_cfg.num_local_experts // 2
        assert torch.equal(torch.cat([r[name] for r in ranks]), full[name]), name


def test_config_of_written_checkpoints_parses(ckpts, tiny_cfg):
    for layout in ("hub", "transformers"):
        assert load_config(ckpts.path(tiny_cfg, SEED, layout)) == tiny_cfg


@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_a_tp_rank_reads_only_its_slices_from_disk(ckpts, tiny_cfg, layout, monkeypatch):
    """Count the elements each get_slice read returns: a tp=2 rank reads half of every sharded tensor and all
    of the replicated ones, never a whole sharded tensor."""
    import math

    import safetensors

    real_open = safetensors.safe_open
    reads: dict[str, int] = {}

    class CountingSlice:
        def __init__(self, sl, key):
            self.sl, self.key = sl, key

        def get_shape(self):
            return self.sl.get_shape()

        def __getitem__(self, index):
            out = self.sl[index]
            reads[self.key] = reads.get(self.key, 0) + out.numel()
            return out

    class CountingOpen:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return CountingSlice(self.inner.get_slice(key), key)

    monkeypatch.setattr(safetensors, "safe_open", CountingOpen)
    d = ckpts.path(tiny_cfg, SEED, layout)
    load_model(d, ctx=_ctx(2, 1))
    shapes = {}
    for shard in d.glob("*.safetensors"):
        with real_open(str(shard), "pt") as f:
            shapes.update({k: f.get_slice(k).get_shape() for k in f.keys()})
    replicated = ("norm.weight", "mlp.gate.weight", "moe.gate.weight", "e_score_correction_bias", "index_k_proj",
                  "indexer.k_proj")
    for key, n in reads.items():
        full = math.prod(shapes[key])
        want = full if any(r in key for r in replicated) else full // 2
        assert n == want, f"{key}: read {n} of {full} elements"
    assert sum(reads.values()) < 0.6 * sum(math.prod(shapes[k]) for k in reads)


@pytest.mark.parametrize("preset,tp", [("m3", 1), ("m3", 8), ("m3-slice", 4)])
@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_full_size_plans_accept_every_checkpoint_tensor(preset, tp, layout):
    """Real M3 shapes (60 layers, 128 experts, vocab 200064) on the meta device: every tensor the checkpoint
    writer emits maps to a parameter, every parameter is covered, and each loader accepts the tensor's shape
    (tp=8 replicates the 4 KV heads)."""
    from msa.checkpoint import checkpoint_tensors
    from msa.config import M3Config
    from msa.weights import load_plan
    from workers.configio import load_yaml, preset_path

    cfg = load_yaml(preset_path("models", preset), M3Config)
    ctx = _ctx(tp, tp - 1)
    model = M3ForCausalLM(cfg, ctx=ctx, device="meta", dtype=torch.bfloat16)
    prefix = "language_model." if layout == "hub" else ""
    outs = [o for o in checkpoint_tensors(cfg, layout) if o.key.startswith(prefix) and ".mtp." not in o.key]
    plan = load_plan(model, layout)
    assert {o.key[len(prefix):] for o in outs} == set(plan)
    params = dict(model.named_parameters())
    for o in outs:
        name, shard = plan[o.key[len(prefix):]]
        params[name].weight_loader(params[name], torch.empty(o.shape, device="meta"), shard)
    attn = model.model.layers[-1].self_attn
    assert attn.qkv_proj.num_heads == cfg.num_attention_heads // tp
    assert attn.qkv_proj.num_kv_heads == max(1, cfg.num_key_value_heads // tp)
