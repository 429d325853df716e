"""The strict YAML -> frozen dataclass loader (workers.configio) and the model presets it loads."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from msa.config import M3Config
from workers.config import EngineConfig
from workers.configio import ConfigError, from_dict, load_yaml, preset_path, to_dict


@dataclass(frozen=True, kw_only=True)
class Inner:
    size: int = 1
    ratio: float = 0.5
    mode: Literal["fast", "exact"] = "fast"


@dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    inner: Inner = field(default_factory=Inner)
    layers: tuple[int, ...] = ()
    limit: int | None = None


def write(tmp_path, text: str):
    path = tmp_path / "case.yaml"
    path.write_text(text)
    return path


def error_of(path, cls=Outer) -> str:
    with pytest.raises(ConfigError) as e:
        load_yaml(path, cls)
    return str(e.value)


def test_valid_file_loads_with_types_and_defaults(tmp_path):
    cfg = load_yaml(write(tmp_path, "name: a\ninner: {size: 3, ratio: 2}\nlayers: [1, 2]\n"), Outer)
    assert cfg == Outer(name="a", inner=Inner(size=3, ratio=2.0), layers=(1, 2))
    assert isinstance(cfg.inner.ratio, float) and isinstance(cfg.layers, tuple)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.name = "b"  # type: ignore[misc]


def test_unknown_key_names_file_key_and_reason(tmp_path):
    path = write(tmp_path, "name: a\nnmae: typo\n")
    msg = error_of(path)
    assert str(path) in msg and "nmae" in msg and "unknown key" in msg


def test_unknown_nested_key_is_named_with_its_dotted_path(tmp_path):
    path = write(tmp_path, "name: a\ninner: {size: 2, colour: red}\n")
    msg = error_of(path)
    assert str(path) in msg and "inner.colour" in msg and "unknown key" in msg


def test_wrong_type_names_file_key_and_reason(tmp_path):
    path = write(tmp_path, "name: a\ninner: {size: many}\n")
    msg = error_of(path)
    assert str(path) in msg and "inner.size" in msg and "expected int" in msg and "'many'" in msg


@pytest.mark.parametrize("text,key,reason", [
    ("name: 3\n", "name", "expected str"),
    ("name: a\ninner: {size: true}\n", "inner.size", "expected int"),  # a bool is not an int
    ("name: a\nlayers: [1, x]\n", "layers[1]", "expected int"),
    ("name: a\nlayers: 5\n", "layers", "expected a list"),
    ("name: a\ninner: 7\n", "inner", "expected a mapping"),
    ("name: a\nlimit: lots\n", "limit", "lots"),
])
def test_wrong_types_everywhere(tmp_path, text, key, reason):
    path = write(tmp_path, text)
    msg = error_of(path)
    assert str(path) in msg and key in msg and reason in msg, msg


def test_literal_choices_are_enforced_and_listed(tmp_path):
    path = write(tmp_path, "name: a\ninner: {mode: slow}\n")
    msg = error_of(path)
    assert str(path) in msg and "inner.mode" in msg and "'slow'" in msg and "fast" in msg and "exact" in msg
    assert load_yaml(write(tmp_path, "name: a\ninner: {mode: exact}\n"), Outer).inner.mode == "exact"


def test_missing_required_key(tmp_path):
    msg = error_of(write(tmp_path, "layers: [1]\n"))
    assert "name" in msg and "required" in msg


def test_missing_file_names_the_file(tmp_path):
    path = tmp_path / "nope.yaml"
    msg = error_of(path)
    assert str(path) in msg and "no such config file" in msg


def test_invalid_yaml_and_non_mapping(tmp_path):
    assert "not valid YAML" in error_of(write(tmp_path, "name: [unclosed\n"))
    assert "expected a mapping" in error_of(write(tmp_path, "- 1\n- 2\n"))


def test_dataclass_validation_error_is_a_config_error_naming_the_field(tmp_path):
    path = write(tmp_path, "max_model_len: 0\n")
    msg = error_of(path, EngineConfig)
    assert str(path) in msg and "max_model_len" in msg


def test_dict_source_and_round_trip():
    cfg = from_dict(Outer, {"name": "x", "inner": {"mode": "exact"}, "layers": [4]}, source="<test>")
    assert from_dict(Outer, to_dict(cfg)) == cfg
    with pytest.raises(ConfigError, match="<test>: inner.size"):
        from_dict(Outer, {"name": "x", "inner": {"size": 1.5}}, source="<test>")


def test_unknown_preset_lists_the_existing_ones():
    with pytest.raises(ConfigError) as e:
        preset_path("models", "huge")
    assert "huge" in str(e.value) and "tiny" in str(e.value)


@pytest.mark.parametrize("preset,num_dense", [("tiny", 1), ("m3-slice", 1), ("m3", 3)])
def test_model_presets_load(preset, num_dense):
    cfg = load_yaml(preset_path("models", preset), M3Config)
    layers = range(cfg.num_hidden_layers)
    assert [i for i in layers if not cfg.is_sparse(i)] == list(range(num_dense))
    assert [i for i in layers if not cfg.is_moe(i)] == list(range(num_dense))


def test_tiny_preset_is_the_issue_shape():
    c = load_yaml(preset_path("models", "tiny"), M3Config)
    assert c.vocab_size >= 300 and c.hidden_size == 128 and c.num_hidden_layers == 4
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rotary_dim) == (8, 2, 32, 16)
    assert (c.num_local_experts, c.num_experts_per_tok) == (8, 2)
    assert (c.index_n_heads, c.index_head_dim, c.index_block_size, c.index_topk_blocks, c.index_local_blocks) == \
        (2, 32, 16, 4, 1)
    assert c.sparse_layers == (1, 2, 3) and c.moe_layers == (1, 2, 3)


def test_m3_preset_matches_the_release():
    c = load_yaml(preset_path("models", "m3"), M3Config)
    assert c.num_hidden_layers == 60 and c.sparse_layers == tuple(range(3, 60)) and c.moe_layers == tuple(range(3, 60))
    assert c.kv_bytes_per_token(2) == 137_472  # M3_SPEC.md §4
    slice_ = load_yaml(preset_path("models", "m3-slice"), M3Config)
    # The slice keeps every per-layer shape of the release; only the depth differs.
    same = {f.name for f in dataclasses.fields(M3Config)} - {"num_hidden_layers", "layer_types", "mlp_layer_types"}
    assert {k: getattr(slice_, k) for k in same} == {k: getattr(c, k) for k in same}
    assert slice_.num_hidden_layers == 4 and slice_.sparse_layers == (1, 2, 3)
