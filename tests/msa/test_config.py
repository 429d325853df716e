"""Every config.json form users meet parses to the same M3Config; unsupported variants are refused by field name.

The transformers reference (`MiniMaxM3VLTextConfig` / `MiniMaxM3VLConfig`) is used both as a source of real
`to_dict()` output and as the oracle for how the legacy keys map to per-layer types.
"""
from __future__ import annotations

import copy
import json

import pytest

from msa.config import M3Config, UnsupportedConfig, load_config, parse_config
from workers.configio import load_yaml, preset_path

transformers_m3 = pytest.importorskip("transformers.models.minimax_m3_vl")


def preset(name: str) -> M3Config:
    return load_yaml(preset_path("models", name), M3Config)


@pytest.fixture(scope="module")
def tiny() -> M3Config:
    return preset("tiny")


def reference_text_config(raw_text: dict):
    kwargs = {k: v for k, v in raw_text.items() if k not in ("model_type",)}
    return transformers_m3.MiniMaxM3VLTextConfig(**kwargs)


# --- every form -> the same config --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny", "m3-slice", "m3"])
def test_hub_and_native_forms_round_trip(name):
    cfg = preset(name)
    assert parse_config(cfg.to_hub_dict()) == cfg
    assert parse_config(cfg.to_hf_text_dict()) == cfg


def test_hub_wrapper_uses_legacy_keys(tiny):
    raw = tiny.to_hub_dict()
    text = raw["text_config"]
    # The form under test really is the legacy one: no native per-layer or indexer keys present.
    assert raw["model_type"] == "minimax_m3_vl" and "vision_config" in raw
    assert not {"layer_types", "mlp_layer_types", "index_n_heads", "rope_parameters"} & set(text)
    assert text["sparse_attention_config"]["sparse_attention_freq"] == [0, 1, 1, 1]
    assert text["moe_layer_freq"] == [0, 1, 1, 1]
    assert parse_config(raw) == tiny


def test_text_only_legacy_config(tiny):
    text = copy.deepcopy(tiny.to_hub_dict()["text_config"])
    assert text["model_type"] == "minimax_m3_vl_text"
    assert parse_config(text) == tiny


def test_top_level_rope_keys_instead_of_rope_parameters(tiny):
    raw = tiny.to_hf_text_dict()
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope["rope_theta"]
    raw["partial_rotary_factor"] = rope["partial_rotary_factor"]
    raw.pop("rotary_dim")
    assert parse_config(raw) == tiny
    # rotary_dim alone is enough too
    raw.pop("partial_rotary_factor")
    raw["rotary_dim"] = tiny.rotary_dim
    assert parse_config(raw) == tiny


def test_native_keys_win_over_legacy_ones(tiny):
    raw = tiny.to_hub_dict()
    raw["text_config"]["index_topk_blocks"] = 7
    raw["text_config"]["sparse_attention_config"]["sparse_topk_blocks"] = 3
    assert parse_config(raw).index_topk_blocks == 7


def test_what_transformers_save_pretrained_writes(tiny):
    """The dict the reference config serialises (dtype key, rope_parameters, extra training fields)."""
    ref = reference_text_config(tiny.to_hf_text_dict())
    raw = ref.to_dict()
    assert parse_config(json.loads(json.dumps(raw))) == tiny


def test_reference_wrapper_config_parses(tiny):
    hub = tiny.to_hub_dict()
    ref = transformers_m3.MiniMaxM3VLConfig(text_config=hub["text_config"], vision_config=hub["vision_config"])
    assert parse_config(json.loads(json.dumps(ref.to_dict()))) == tiny


def test_reference_reads_the_legacy_keys_like_we_do(tiny):
    """transformers' own legacy-key handling gives the per-layer types and indexer sizes we parse."""
    ref = reference_text_config(tiny.to_hub_dict()["text_config"])
    assert tuple(ref.layer_types) == tiny.layer_types
    assert tuple(ref.mlp_layer_types) == tiny.mlp_layer_types
    for field in ("index_n_heads", "index_head_dim", "index_block_size", "index_topk_blocks", "index_local_blocks",
                  "rotary_dim", "num_local_experts", "num_experts_per_tok"):
        assert getattr(ref, field) == getattr(tiny, field), field


def test_load_config_reads_the_directory(tmp_path, tiny):
    (tmp_path / "config.json").write_text(json.dumps(tiny.to_hub_dict()))
    assert load_config(tmp_path) == tiny
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path / "missing")


# --- refusals name the field ---------------------------------------------------------------------------------------

def hub_with(tiny: M3Config, edit) -> dict:
    raw = copy.deepcopy(tiny.to_hub_dict())
    edit(raw, raw["text_config"], raw["text_config"]["sparse_attention_config"])
    return raw


def native_with(tiny: M3Config, edit) -> dict:
    raw = copy.deepcopy(tiny.to_hf_text_dict())
    edit(raw)
    return raw


REFUSALS = [
    ("rope_type yarn", lambda t: native_with(t, lambda r: r["rope_parameters"].update(rope_type="yarn", factor=4.0)),
     "rope_type"),
    ("legacy rope_scaling", lambda t: hub_with(t, lambda r, x, s: x.update(rope_scaling={"type": "linear",
                                                                                          "factor": 2.0})),
     "rope"),
    ("init blocks", lambda t: hub_with(t, lambda r, x, s: s.update(sparse_init_block=1)), "sparse_init_block"),
    ("score type", lambda t: hub_with(t, lambda r, x, s: s.update(sparse_score_type="mean")), "sparse_score_type"),
    ("index value branch", lambda t: hub_with(t, lambda r, x, s: s.update(sparse_disable_index_value=[0, 0, 1, 1])),
     "sparse_disable_index_value"),
    ("quantized wrapper", lambda t: hub_with(t, lambda r, x, s: r.update(quantization_config={"quant_method": "fp8"})),
     "quantization_config"),
    ("quantized text", lambda t: hub_with(t, lambda r, x, s: x.update(quantization_config={"quant_method": "mxfp8"})),
     "quantization_config"),
    ("quantized native", lambda t: native_with(t, lambda r: r.update(quantization_config={"quant_method": "nvfp4"})),
     "quantization_config"),
    ("unknown model_type", lambda t: native_with(t, lambda r: r.update(model_type="llama")), "model_type"),
    ("output gate", lambda t: native_with(t, lambda r: r.update(use_output_gate=True)), "use_output_gate"),
    ("layer_types length", lambda t: native_with(t, lambda r: r.update(layer_types=r["layer_types"][:2])),
     "layer_types"),
    ("unknown layer type", lambda t: native_with(t, lambda r: r["layer_types"].__setitem__(1, "sliding_attention")),
     "layer_types"),
    ("rotary mismatch", lambda t: native_with(t, lambda r: r.update(rotary_dim=8)), "rotary_dim"),
    ("block size", lambda t: native_with(t, lambda r: r.update(index_block_size=24)), "index_block_size"),
    ("missing hidden_size", lambda t: native_with(t, lambda r: r.pop("hidden_size")), "hidden_size"),
]


@pytest.mark.parametrize("case,make,field", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_unsupported_variants_are_refused_naming_the_field(tiny, case, make, field):
    raw = make(tiny)
    with pytest.raises(UnsupportedConfig) as e:
        parse_config(raw, source="ckpt/config.json")
    msg = str(e.value)
    assert field in msg and "ckpt/config.json" in msg, msg


def test_refusal_cases_are_valid_without_the_edit(tiny):
    """Guards the table above: each refusal comes from its edit, not from a broken base config."""
    assert parse_config(hub_with(tiny, lambda r, x, s: None)) == tiny
    assert parse_config(native_with(tiny, lambda r: None)) == tiny


def test_mtp_and_vision_fields_are_ignored(tiny):
    raw = hub_with(tiny, lambda r, x, s: (r.update(mm_projector_type="mlp2x"), x.update(num_mtp_modules=1,
                                                                                         mtp_transformer_layers=1)))
    assert parse_config(raw) == tiny


@pytest.mark.parametrize("where", ["text", "top", "both"])
def test_checkpoint_dtype_is_read_from_whichever_level_carries_it(tiny, where):
    raw = copy.deepcopy(tiny.to_hub_dict())
    for d in (raw, raw["text_config"]):
        d.pop("torch_dtype", None), d.pop("dtype", None)
    if where in ("text", "both"):
        raw["text_config"]["torch_dtype"] = "float16"
    if where in ("top", "both"):
        raw["torch_dtype"] = "float32" if where == "both" else "float16"
    # the text config wins when both carry one; the wrapper's top level is read when only it does
    assert parse_config(raw).torch_dtype == "float16"
    raw["text_config"].pop("torch_dtype", None)
    raw["dtype"] = raw.pop("torch_dtype", "float32")
    assert parse_config(raw).torch_dtype == raw["dtype"]


def test_dtype_spellings_and_refusal(tiny):
    text = copy.deepcopy(tiny.to_hf_text_dict())
    text["torch_dtype"] = "torch.float32"
    assert parse_config(text).torch_dtype == "float32"
    text["torch_dtype"] = "int8"
    with pytest.raises(UnsupportedConfig, match="torch_dtype"):
        parse_config(text)
