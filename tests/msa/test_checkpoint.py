"""Random checkpoints (msa.checkpoint), the cached tiny model (workers.models) and `m3serve checkpoint`.

The oracle is transformers' `MiniMaxM3VLForCausalLM`: the transformers layout must load into it with no
missing/unexpected keys; the hub layout, converted with the key mapping of M3_SPEC.md §2 written out below, must
load into it and give the very same logits (both layouts carry the same weights for a seed).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from msa.checkpoint import (BOS, CHAT_TEMPLATE, EOS, HUB_PREFIX, ROLE_TOKENS, build_tokenizer, checkpoint_tensors,
                            write_checkpoint)
from msa.config import M3Config, load_config
from workers.configio import load_yaml, preset_path

ref_mod = pytest.importorskip("transformers.models.minimax_m3_vl")
MiniMaxM3VLForCausalLM = ref_mod.MiniMaxM3VLForCausalLM
MiniMaxM3VLTextConfig = ref_mod.MiniMaxM3VLTextConfig

SEED = 3


@pytest.fixture(scope="module")
def cfg() -> M3Config:
    return load_yaml(preset_path("models", "tiny"), M3Config)


@pytest.fixture(scope="module")
def hub_dir(cfg, tmp_path_factory) -> Path:
    return write_checkpoint(cfg, tmp_path_factory.mktemp("hub"), seed=SEED, layout="hub", num_shards=2)


@pytest.fixture(scope="module")
def hf_dir(cfg, tmp_path_factory) -> Path:
    return write_checkpoint(cfg, tmp_path_factory.mktemp("hf"), seed=SEED, layout="transformers", num_shards=3)


@pytest.fixture(scope="module")
def hf_model(hf_dir):
    model, info = MiniMaxM3VLForCausalLM.from_pretrained(hf_dir, output_loading_info=True, dtype=torch.float32)
    return model.eval(), info


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(model_dir / shard), "pt") as f:
            for key in f.keys():
                assert index["weight_map"][key] == shard, key
                tensors[key] = f.get_tensor(key)
    assert set(tensors) == set(index["weight_map"])
    return tensors


# --- the hub -> transformers key conversion of M3_SPEC.md §2, written independently of the writer -----------------

SKIPPED = re.compile(r"^(vision_tower|multi_modal_projector|patch_merge_mlp)\.|(^|\.)mtp\.")
RENAMES = [
    (r"\.self_attn\.index_(q|k)_proj\.", r".self_attn.indexer.\1_proj."),
    (r"\.self_attn\.index_(q|k)_norm\.", r".self_attn.indexer.\1_norm."),
    (r"\.block_sparse_moe\.e_score_correction_bias$", r".mlp.gate.e_score_correction_bias"),
    (r"\.block_sparse_moe\.", r".mlp."),
]


def hub_to_transformers(hub: dict[str, torch.Tensor], cfg: M3Config) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for key, t in hub.items():
        if SKIPPED.search(key):
            continue
        assert key.startswith(HUB_PREFIX), key
        key = key[len(HUB_PREFIX):]
        for pat, rep in RENAMES:
            key = re.sub(pat, rep, key)
        out[key] = t
    for i in range(cfg.num_hidden_layers):
        mlp = f"model.layers.{i}.mlp."
        if cfg.is_moe(i):
            experts = range(cfg.num_local_experts)
            w1 = [out.pop(f"{mlp}experts.{e}.w1.weight") for e in experts]
            w3 = [out.pop(f"{mlp}experts.{e}.w3.weight") for e in experts]
            w2 = [out.pop(f"{mlp}experts.{e}.w2.weight") for e in experts]
            out[f"{mlp}experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(w1, w3)])
            out[f"{mlp}experts.down_proj"] = torch.stack(w2)
            mlp = mlp + "shared_experts."
        gate, up = out.pop(f"{mlp}gate_proj.weight"), out.pop(f"{mlp}up_proj.weight")
        out[f"{mlp}gate_up_proj.weight"] = torch.cat([gate, up])
    return out


def reference_from_hub(hub_dir: Path):
    """The reference built from the hub config.json's text_config (legacy keys) with converted hub weights."""
    text = json.loads((hub_dir / "config.json").read_text())["text_config"]
    model = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**{k: v for k, v in text.items() if k != "model_type"}))
    converted = hub_to_transformers(read_all(hub_dir), load_config(hub_dir))
    result = model.load_state_dict(converted, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model.float().eval()


PROMPTS = [[1, 40, 41, 42], [1, 300, 7, 99, 150], [1, 5], [1, 200, 201, 202, 203, 204, 205]]


# --- transformers layout ------------------------------------------------------------------------------------------

def test_transformers_layout_matches_the_reference_state_dict(cfg, hf_dir):
    ref = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**{k: v for k, v in cfg.to_hf_text_dict().items()
                                                           if k != "model_type"}))
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in read_all(hf_dir).items()}
    assert got == want


def test_transformers_layout_loads_without_missing_or_unexpected_keys(hf_model):
    _, info = hf_model
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_transformers_layout_generates_and_tokens_vary(hf_model, cfg):
    model, _ = hf_model
    outs = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             pad_token_id=0)
        new = gen[0, len(prompt):].tolist()
        assert len(new) >= 1 and all(0 <= t < cfg.vocab_size for t in new)
        outs.append(tuple(new))
    # Not degenerate: different prompts continue differently, and a continuation is not one token repeated.
    assert len(set(outs)) == len(outs), outs
    assert max(len(set(o)) for o in outs) >= 3, outs


def test_activations_stay_order_one_and_logits_spread(hf_model, cfg):
    model, _ = hf_model
    ids = torch.randint(0, cfg.vocab_size, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for i, h in enumerate(out.hidden_states[:-1]):
        rms = h.float().pow(2).mean().sqrt().item()
        assert 0.3 < rms < 10, (i, rms)
    logits = out.logits[0]
    assert 0.3 < logits.std().item() < 10
    assert logits.argmax(-1).unique().numel() > 20  # greedy choice depends on the context


# --- hub layout ---------------------------------------------------------------------------------------------------

def test_hub_layout_keys_follow_the_spec(hub_dir, cfg):
    tensors = read_all(hub_dir)
    h, e, inter = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size
    p = HUB_PREFIX + "model.layers.1."
    expect = {
        HUB_PREFIX + "model.embed_tokens.weight": (cfg.vocab_size, h),
        HUB_PREFIX + "lm_head.weight": (cfg.vocab_size, h),
        HUB_PREFIX + "model.norm.weight": (h,),
        p + "self_attn.q_norm.weight": (cfg.head_dim,),
        p + "self_attn.index_q_proj.weight": (cfg.index_n_heads * cfg.index_head_dim, h),
        p + "self_attn.index_k_proj.weight": (cfg.index_head_dim, h),
        p + "self_attn.index_q_norm.weight": (cfg.index_head_dim,),
        p + "self_attn.index_k_norm.weight": (cfg.index_head_dim,),
        p + "block_sparse_moe.gate.weight": (e, h),
        p + "block_sparse_moe.e_score_correction_bias": (e,),
        p + f"block_sparse_moe.experts.{e - 1}.w1.weight": (inter, h),
        p + f"block_sparse_moe.experts.{e - 1}.w3.weight": (inter, h),
        p + f"block_sparse_moe.experts.{e - 1}.w2.weight": (h, inter),
        p + "block_sparse_moe.shared_experts.up_proj.weight": (cfg.shared_intermediate_size, h),
        HUB_PREFIX + "model.layers.0.mlp.gate_proj.weight": (cfg.dense_intermediate_size, h),
        HUB_PREFIX + "model.layers.0.mlp.down_proj.weight": (h, cfg.dense_intermediate_size),
    }
    for key, shape in expect.items():
        assert tuple(tensors[key].shape) == shape, key
    assert not any("index_" in k for k in tensors if ".layers.0." in k)  # layer 0 is dense attention
    assert any(k.startswith("vision_tower.") for k in tensors)
    assert any(k.startswith("multi_modal_projector.") for k in tensors)
    assert any(".mtp." in k for k in tensors)
    assert all(k.startswith(HUB_PREFIX) or SKIPPED.search(k) for k in tensors)


def test_hub_layout_loads_into_the_reference_with_identical_logits(hub_dir, hf_model):
    model, _ = hf_model
    ref_hub = reference_from_hub(hub_dir)
    ids = torch.randint(0, 384, (1, 90), generator=torch.Generator().manual_seed(1))  # > 64: selection active
    with torch.no_grad():
        a, b = ref_hub(ids).logits, model(ids).logits
    assert torch.equal(a, b)
    gen = ref_hub.generate(ids[:, :5], attention_mask=torch.ones(1, 5, dtype=torch.long), max_new_tokens=4,
                           do_sample=False, pad_token_id=0)
    assert gen.shape[1] == 9


def test_both_layouts_and_shardings_carry_the_same_weights(hub_dir, hf_dir, cfg):
    hub = hub_to_transformers(read_all(hub_dir), cfg)
    hf = read_all(hf_dir)
    assert hub.keys() == hf.keys()
    for key in hf:
        assert torch.equal(hub[key], hf[key]), key


# --- weight properties --------------------------------------------------------------------------------------------

def test_weights_exercise_every_term(hub_dir, cfg):
    t = read_all(hub_dir)
    norms = [k for k in t if k.endswith("norm.weight") and "mtp" not in k]
    # input/post-attention norms and q/k norms per layer, index q/k norms per sparse layer, the final norm
    assert len(norms) == 4 * cfg.num_hidden_layers + 2 * len(cfg.sparse_layers) + 1
    for k in norms:
        assert t[k].abs().min() > 0 and t[k].std() > 0.05, k  # a stored 0 would make the Gemma norm trivial
    for i in cfg.moe_layers:
        p = f"{HUB_PREFIX}model.layers.{i}.block_sparse_moe."
        gate, bias = t[p + "gate.weight"], t[p + "e_score_correction_bias"]
        assert gate.dtype == torch.float32 and bias.dtype == torch.float32
        assert bias.abs().min() > 0
        # On unit-RMS inputs the bias changes which experts are picked for a good share of tokens.
        h = torch.randn(512, cfg.hidden_size, generator=torch.Generator().manual_seed(i))
        s = torch.sigmoid(h @ gate.T)
        k = cfg.num_experts_per_tok
        plain = s.topk(k, -1).indices.sort(-1).values
        biased = (s + bias).topk(k, -1).indices.sort(-1).values
        changed = (plain != biased).any(-1).float().mean().item()
        assert 0.05 < changed < 0.9, changed
        # Every expert gets picked by some token: the router is not collapsed onto a few experts.
        assert biased.unique().numel() == cfg.num_local_experts
        # Expert gate pre-activations reach the SwiGLU-OAI clamp now and then, but rarely.
        w1 = t[p + "experts.0.w1.weight"]
        frac = ((h / h.pow(2).mean(-1, keepdim=True).sqrt()) @ w1.T > cfg.swiglu_limit).float().mean().item()
        assert 0 < frac < 0.02, frac


def test_sparse_selection_matters_beyond_topk_blocks(hf_model, cfg):
    """Same weights with every layer dense: equal up to topk*block tokens, different after (M3_SPEC.md §3)."""
    model, _ = hf_model
    dense_cfg = dataclasses.replace(cfg, layer_types=("full_attention",) * cfg.num_hidden_layers)
    dense = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**{k: v for k, v in dense_cfg.to_hf_text_dict().items()
                                                             if k != "model_type"}))
    sd = {k: v for k, v in model.state_dict().items() if ".indexer." not in k}
    dense.load_state_dict(sd, strict=True)
    dense.eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 160), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model(ids).logits[0], dense(ids).logits[0]
    n = cfg.index_topk_blocks * cfg.index_block_size
    assert torch.allclose(a[:n], b[:n], atol=1e-4, rtol=1e-4)
    diff = (a[n:] - b[n:]).abs().amax(-1)
    assert diff.mean() > 1e-2, diff  # block selection changes the output visibly


def test_same_seed_same_bytes_other_seed_other_weights(cfg, tmp_path, hub_dir):
    again = write_checkpoint(cfg, tmp_path / "again", seed=SEED, layout="hub", num_shards=2)
    for shard in sorted(p.name for p in hub_dir.glob("*.safetensors")):
        assert (again / shard).read_bytes() == (hub_dir / shard).read_bytes(), shard
    other = read_all(write_checkpoint(cfg, tmp_path / "other", seed=SEED + 1, layout="hub", num_shards=1))
    base = read_all(hub_dir)
    assert base.keys() == other.keys()
    assert not any(torch.equal(base[k], other[k]) for k in base)


def test_index_and_shards_are_consistent(hf_dir, cfg):
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(set(index["weight_map"].values())) == shards
    tensors = read_all(hf_dir)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Ranks read slices without loading whole tensors.
    key = "model.layers.1.mlp.experts.gate_up_proj"
    with safe_open(str(hf_dir / index["weight_map"][key]), "pt") as f:
        part = f.get_slice(key)[2:4]
    assert torch.equal(part, tensors[key][2:4])


def test_dtype_override_keeps_router_fp32(cfg, tmp_path):
    d = write_checkpoint(cfg, tmp_path / "bf16", seed=SEED, layout="transformers", num_shards=2, dtype=torch.bfloat16)
    t = read_all(d)
    assert t["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert t["model.layers.1.mlp.experts.gate_up_proj"].dtype == torch.bfloat16
    assert load_config(d).torch_dtype == "bfloat16"
    model = MiniMaxM3VLForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([PROMPTS[0]])).logits).all()


def test_stream_writer_plan_for_the_full_size_presets():
    """The m3-slice/m3 plans (no data written): the parameter count of the release and bounded draw sizes."""
    m3 = load_yaml(preset_path("models", "m3"), M3Config)
    outs = checkpoint_tensors(m3, "hub")
    text = [o for o in outs if o.key.startswith(HUB_PREFIX) and ".mtp." not in o.key]
    params = sum(math.prod(o.shape) for o in text)
    assert 420e9 < params < 440e9, params  # "428B parameters"
    # Streaming: no single draw block is bigger than _ROW_BLOCK rows of the widest matrix.
    from msa.checkpoint import _ROW_BLOCK
    widest = max(math.prod(d.shape[1:]) for o in outs for d in o.draws)
    assert widest * _ROW_BLOCK * 4 < 2**30


# --- tokenizer ----------------------------------------------------------------------------------------------------

UNICODE_SAMPLES = [
    "", " ", "hello world", "  leading and trailing  ", "tabs\tand\nnewlines\r\n", "naïve café über straße",
    "机器学习模型可以生成文本。", "日本語のテキスト", "Привет, мир!", "emoji 🙂🚀👩‍👩‍👧 flags 🇫🇷", "\u0000\u0001\u007f",
    "combining e\u0301 and zero\u200bwidth", "mathematical 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "<|user|> looks special", "<unused5>",
]


@pytest.fixture(scope="module")
def tok(cfg):
    return build_tokenizer(cfg)


def test_tokenizer_has_the_config_vocab_and_special_ids(tok, cfg):
    tokenizer, special = tok
    assert tokenizer.get_vocab_size(with_added_tokens=True) == cfg.vocab_size
    assert special.bos_id == cfg.bos_token_id and special.eos_id == cfg.eos_token_id[0]
    assert tokenizer.token_to_id(BOS) == cfg.bos_token_id and tokenizer.token_to_id(EOS) == cfg.eos_token_id[0]
    ids = sorted(special.by_token().values())
    assert len(set(ids)) == len(ids) == 6 and max(ids) < cfg.vocab_size
    assert sorted(tokenizer.get_vocab().values()) == list(range(cfg.vocab_size))  # dense, no holes


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_tokenizer_round_trips_unicode(tok, text):
    tokenizer, special = tok
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    if "<|" not in text:
        assert not set(ids) & set(special.by_token().values())


def test_tokenizer_round_trips_random_text(tok):
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    tokenizer, _ = tok

    @hypothesis.settings(max_examples=150, deadline=None, derandomize=True)
    @hypothesis.given(st.text(max_size=64))
    def check(text):
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.decode(ids, skip_special_tokens=False) == text

    check()


def test_tokenizer_merges_common_text(tok):
    tokenizer, _ = tok
    text = "The quick brown fox answers the question."
    assert len(tokenizer.encode(text).ids) < len(text.encode()) * 0.7  # learned merges, not raw bytes


def test_large_vocab_places_specials_where_the_config_says():
    m3 = load_yaml(preset_path("models", "m3"), M3Config)
    tokenizer, special = build_tokenizer(m3)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 200064
    assert tokenizer.token_to_id(BOS) == 200034 and tokenizer.token_to_id(EOS) == 200020
    text = "héllo 世界 🙂"
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_auto_tokenizer_loads_and_renders_the_chat_template(hub_dir, tok, cfg):
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(hub_dir)
    tokenizer, special = tok
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (special.bos_id, special.eos_id,
                                                                          special.pad_id)
    assert len(auto) == cfg.vocab_size
    for text in UNICODE_SAMPLES:
        ids = auto.encode(text, add_special_tokens=False)
        assert ids == tokenizer.encode(text, add_special_tokens=False).ids
        assert auto.decode(ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ü 世界"},
                {"role": "assistant", "content": "Hello."}, {"role": "user",
                                                              "content": [{"type": "text", "text": "Again"}]}]
    rendered = auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi ü 世界<|eos|>\n"
                        "<|assistant|>\nHello.<|eos|>\n<|user|>\nAgain<|eos|>\n<|assistant|>\n")
    no_prompt = auto.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=False)
    assert not no_prompt.endswith("<|assistant|>\n") and no_prompt.endswith("<|eos|>\n")
    ids = auto.encode(rendered, add_special_tokens=False)
    assert ids[0] == special.bos_id and ids.count(special.eos_id) == 4
    assert special.role_ids["user"] in ids and ids[-2] == special.role_ids["assistant"]
    # Tool results are a turn of their own (issue 20: the M3 template, msa/chat_template.py); <|tool|> is text,
    # not a special token, so the vocabulary stays as it was. Unknown roles are still refused.
    tool_turn = auto.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False,
                                         add_generation_prompt=False)
    assert tool_turn == "<|bos|><|tool|>\nx<|eos|>\n"
    assert auto.convert_tokens_to_ids("<|tool|>") in (None, auto.unk_token_id)
    with pytest.raises(Exception, match="unknown chat role"):
        auto.apply_chat_template([{"role": "wizard", "content": "x"}], tokenize=False)


def test_chat_template_renders_with_plain_jinja2():
    """Engines that render the template themselves (jinja2 sandbox) get the same text."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    out = env.from_string(CHAT_TEMPLATE).render(messages=[{"role": "user", "content": "x"}],
                                                add_generation_prompt=True, bos_token=BOS, eos_token=EOS)
    assert out == f"{BOS}{ROLE_TOKENS['user']}\nx{EOS}\n{ROLE_TOKENS['assistant']}\n"


# --- CLI and the cached tiny model --------------------------------------------------------------------------------

def test_cli_writes_a_loadable_checkpoint(tmp_path, capsys):
    from deploy.cli import main

    out = tmp_path / "cli"
    rc = main(["checkpoint", "--preset", "tiny", "--out", str(out), "--seed", "5", "--layout", "transformers",
               "--num-shards", "2"])
    assert rc == 0 and str(out) in capsys.readouterr().out
    assert len(list(out.glob("model-*-of-00002.safetensors"))) == 2
    model, info = MiniMaxM3VLForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    gen = model.generate(torch.tensor([PROMPTS[1]]), attention_mask=torch.ones(1, 5, dtype=torch.long),
                         max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert gen.shape == (1, 8)


def test_cli_rejects_bad_arguments(tmp_path, capsys):
    from deploy.cli import main

    with pytest.raises(SystemExit) as e:
        main(["checkpoint", "--out", str(tmp_path / "x"), "--layout", "gguf"])
    assert e.value.code == 2 and "gguf" in capsys.readouterr().err
    with pytest.raises(Exception, match="huge"):
        main(["checkpoint", "--preset", "huge", "--out", str(tmp_path / "y")])


def test_tiny_model_dir_is_written_once_and_reused(tmp_path, monkeypatch):
    from workers.models import CACHE_ENV, tiny_model_dir

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first = tiny_model_dir()
    assert first.parent == tmp_path / "cache" and first.name.startswith("tiny-")
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}
    assert tiny_model_dir() == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == mtimes  # not rewritten
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [first.name]  # no temp dirs left behind
    cfg = load_config(first)
    assert cfg == load_yaml(preset_path("models", "tiny"), M3Config)
    assert json.loads((first / "config.json").read_text())["model_type"] == "minimax_m3_vl"  # hub layout
    # An explicit cache dir wins over the environment; an incomplete entry is rewritten.
    other = tiny_model_dir(tmp_path / "explicit")
    assert other.parent == tmp_path / "explicit" and other.name == first.name
    (other / "tokenizer.json").unlink()
    assert (tiny_model_dir(tmp_path / "explicit") / "tokenizer.json").is_file()
    assert os.access(first, os.R_OK | os.X_OK)
