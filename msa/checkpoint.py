"""Write random MiniMax-M3 checkpoints exactly as users meet them (M3_SPEC.md §1-2), plus a byte-level tokenizer.

Two weight layouts carry *the same* weights for the same seed:
- ``hub``: the original release: every key prefixed ``language_model.``, per-expert ``w1``/``w3``/``w2``,
  ``block_sparse_moe.*``, ``self_attn.index_*``, separate ``gate_proj``/``up_proj``; a few vision/projector/MTP
  keys the text loader must skip; ``config.json`` is the ``minimax_m3_vl`` wrapper with legacy sparse keys.
- ``transformers``: what ``MiniMaxM3VLForCausalLM.save_pretrained`` writes: no prefix, stacked
  ``mlp.experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows), ``self_attn.indexer.*``, flat config.

Every logical weight (named by its hub key without prefix) is drawn in fixed row blocks, each from its own seeded
generator, so a weight's values depend only on (seed, name, block) - never on layout, sharding or write order.
Tensors are streamed to disk one row block at a time (our own safetensors writer), so a multi-GB preset is
written with memory for one block only.

Scales keep activations O(1) through every layer (pre-norm residual stream, 1/sqrt(fan_in) projections), while
making every term of the math matter: non-zero Gemma norm weights, a decisive fp32 router, a non-zero
`e_score_correction_bias` that changes some selections, and expert gate/up pre-activations wide enough that the
SwiGLU-OAI clamp at `swiglu_limit` fires now and then.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from msa import chat_template
from msa.config import M3Config

HUB = "hub"
TRANSFORMERS = "transformers"
LAYOUTS = (HUB, TRANSFORMERS)
HUB_PREFIX = "language_model."

# Rows drawn per generator call. Part of the weight definition: changing it changes every weight.
_ROW_BLOCK = 1024
# Std of the Gemma norm weights w (the norm scales by 1 + w): visibly non-trivial, never sign-flipping.
_NORM_STD = 0.2
# Std of e_score_correction_bias, relative to sigmoid scores spread ~0.2 around 0.5: flips some top-k choices.
_BIAS_STD = 0.1

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class _Draw:
    """One logical random weight: N(mean, std^2) of `shape`, named by its hub key (no prefix)."""

    name: str
    shape: tuple[int, ...]
    std: float
    mean: float = 0.0
    fp32: bool = False  # router weights stay fp32 in every layout

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class _Out:
    """One tensor in a safetensors file: its bytes are the row-major concatenation of `draws`."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    draws: tuple[_Draw, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _block_seed(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _draw_blocks(draw: _Draw, seed: int, device: torch.device | str) -> Iterator[torch.Tensor]:
    """The weight as fp32 row blocks of `_ROW_BLOCK` rows (dim 0), each from its own generator."""
    rows, rest = draw.shape[0], draw.shape[1:]
    gen = torch.Generator(device=device)
    for block, start in enumerate(range(0, rows, _ROW_BLOCK)):
        n = min(_ROW_BLOCK, rows - start)
        gen.manual_seed(_block_seed(seed, draw.name, block))
        t = torch.randn((n, *rest), generator=gen, device=device, dtype=torch.float32)
        yield t.mul_(draw.std).add_(draw.mean)


# ----------------------------------------------------------------------------------------------------------------
# The logical weights of the text tower, per layer, with their scales.

def _attention_draws(c: M3Config, i: int) -> dict[str, _Draw]:
    p, h, d = f"model.layers.{i}.self_attn.", c.hidden_size, c.head_dim
    in_std = 1.0 / math.sqrt(h)
    draws = {
        "q": _Draw(p + "q_proj.weight", (c.num_attention_heads * d, h), in_std),
        "k": _Draw(p + "k_proj.weight", (c.num_key_value_heads * d, h), in_std),
        "v": _Draw(p + "v_proj.weight", (c.num_key_value_heads * d, h), in_std),
        # Attention averages many values, so o_proj is scaled up to keep its residual update comparable to the MLP's.
        "o": _Draw(p + "o_proj.weight", (h, c.num_attention_heads * d), 2.5 / math.sqrt(c.num_attention_heads * d)),
        # q/k norm weights around 0.5 (scale 1.5): logits q.k/sqrt(d) spread ~2, so attention is peaked enough
        # that which blocks a sparse layer selects changes the output visibly.
        "q_norm": _Draw(p + "q_norm.weight", (d,), _NORM_STD, mean=0.5),
        "k_norm": _Draw(p + "k_norm.weight", (d,), _NORM_STD, mean=0.5),
    }
    if c.is_sparse(i):
        di = c.index_head_dim
        draws |= {
            "index_q": _Draw(p + "index_q_proj.weight", (c.index_n_heads * di, h), in_std),
            "index_k": _Draw(p + "index_k_proj.weight", (di, h), in_std),
            "index_q_norm": _Draw(p + "index_q_norm.weight", (di,), _NORM_STD),
            "index_k_norm": _Draw(p + "index_k_norm.weight", (di,), _NORM_STD),
        }
    return draws


def _swiglu_draws(c: M3Config, prefix: str, names: tuple[str, str, str], inter: int) -> tuple[_Draw, _Draw, _Draw]:
    """gate, up, down of one SwiGLU-OAI MLP. gate/up pre-activations have std ~ swiglu_limit/3 so the clamp
    fires on a few per mille of entries; down is scaled so the MLP adds O(1) to the residual stream."""
    h = c.hidden_size
    wide = (c.swiglu_limit / 3.0) / math.sqrt(h)
    gate = _Draw(prefix + names[0], (inter, h), wide)
    up = _Draw(prefix + names[1], (inter, h), wide)
    down = _Draw(prefix + names[2], (h, inter), 0.2 / math.sqrt(inter))
    return gate, up, down


def _dense_mlp_draws(c: M3Config, i: int) -> tuple[_Draw, _Draw, _Draw]:
    return _swiglu_draws(c, f"model.layers.{i}.mlp.", ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                         c.dense_intermediate_size)


def _moe_draws(c: M3Config, i: int) -> dict[str, object]:
    p = f"model.layers.{i}.block_sparse_moe."
    experts = [_swiglu_draws(c, f"{p}experts.{e}.", ("w1.weight", "w3.weight", "w2.weight"), c.intermediate_size)
               for e in range(c.num_local_experts)]
    return {
        # Router logits ~ N(0, 1) on a unit-RMS input: sigmoid scores spread over (0.1, 0.9).
        "gate": _Draw(p + "gate.weight", (c.num_local_experts, c.hidden_size), 1.0 / math.sqrt(c.hidden_size),
                      fp32=True),
        "bias": _Draw(p + "e_score_correction_bias", (c.num_local_experts,), _BIAS_STD, fp32=True),
        "experts": experts,
        "shared": _swiglu_draws(c, p + "shared_experts.", ("gate_proj.weight", "up_proj.weight", "down_proj.weight"),
                                c.shared_intermediate_size) if c.n_shared_experts else None,
    }


def _layer_norm_draws(c: M3Config, i: int) -> tuple[_Draw, _Draw]:
    p = f"model.layers.{i}."
    return (_Draw(p + "input_layernorm.weight", (c.hidden_size,), _NORM_STD),
            _Draw(p + "post_attention_layernorm.weight", (c.hidden_size,), _NORM_STD))


def _one(key: str, draw: _Draw, dtype: torch.dtype) -> _Out:
    return _Out(key, draw.shape, torch.float32 if draw.fp32 else dtype, (draw,))


def _cat(key: str, draws: tuple[_Draw, ...], dtype: torch.dtype) -> _Out:
    """Rows of `draws` stacked along dim 0 (all share the trailing shape)."""
    rest = draws[0].shape[1:]
    assert all(d.shape[1:] == rest for d in draws), key
    return _Out(key, (sum(d.shape[0] for d in draws), *rest), dtype, draws)


def _stack(key: str, draws: list[tuple[_Draw, ...]], dtype: torch.dtype) -> _Out:
    """[E, rows, cols]: expert e's rows are the concatenation of draws[e]."""
    per = _cat(key, draws[0], dtype).shape
    return _Out(key, (len(draws), *per), dtype, tuple(d for group in draws for d in group))


def _layer_outs(c: M3Config, i: int, layout: str, dtype: torch.dtype) -> list[_Out]:
    pre = HUB_PREFIX if layout == HUB else ""
    attn = _attention_draws(c, i)
    outs = [_one(pre + attn[n].name, attn[n], dtype) for n in ("q", "k", "v", "o", "q_norm", "k_norm")]
    if c.is_sparse(i):
        if layout == HUB:
            outs += [_one(pre + attn[n].name, attn[n], dtype)
                     for n in ("index_q", "index_k", "index_q_norm", "index_k_norm")]
        else:
            ip = f"model.layers.{i}.self_attn.indexer."
            outs += [_one(ip + "q_proj.weight", attn["index_q"], dtype),
                     _one(ip + "k_proj.weight", attn["index_k"], dtype),
                     _one(ip + "q_norm.weight", attn["index_q_norm"], dtype),
                     _one(ip + "k_norm.weight", attn["index_k_norm"], dtype)]
    if c.is_moe(i):
        moe = _moe_draws(c, i)
        if layout == HUB:
            outs += [_one(pre + moe["gate"].name, moe["gate"], dtype), _one(pre + moe["bias"].name, moe["bias"], dtype)]
            for w1, w3, w2 in moe["experts"]:
                outs += [_one(pre + w1.name, w1, dtype), _one(pre + w3.name, w3, dtype), _one(pre + w2.name, w2, dtype)]
            if moe["shared"]:
                outs += [_one(pre + d.name, d, dtype) for d in moe["shared"]]
        else:
            mp = f"model.layers.{i}.mlp."
            outs += [_one(mp + "gate.weight", moe["gate"], dtype),
                     _one(mp + "gate.e_score_correction_bias", moe["bias"], dtype),
                     _stack(mp + "experts.gate_up_proj", [(w1, w3) for w1, w3, _ in moe["experts"]], dtype),
                     _stack(mp + "experts.down_proj", [(w2,) for _, _, w2 in moe["experts"]], dtype)]
            if moe["shared"]:
                g, u, d = moe["shared"]
                outs += [_cat(mp + "shared_experts.gate_up_proj.weight", (g, u), dtype),
                         _one(mp + "shared_experts.down_proj.weight", d, dtype)]
    else:
        g, u, d = _dense_mlp_draws(c, i)
        if layout == HUB:
            outs += [_one(pre + x.name, x, dtype) for x in (g, u, d)]
        else:
            outs += [_cat(f"model.layers.{i}.mlp.gate_up_proj.weight", (g, u), dtype),
                     _one(f"model.layers.{i}.mlp.down_proj.weight", d, dtype)]
    outs += [_one(pre + n.name, n, dtype) for n in _layer_norm_draws(c, i)]
    return outs


def _skipped_hub_outs(c: M3Config, dtype: torch.dtype) -> list[_Out]:
    """Small stand-ins for the non-text weights of the release; a text loader must ignore them."""
    h = c.hidden_size
    draws = [
        _Draw("vision_tower.vision_model.embeddings.patch_embedding.weight", (64, 3, 2, 2, 2), 0.02),
        _Draw("vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight", (32, 64), 0.02),
        _Draw("multi_modal_projector.linear_1.weight", (h, 64), 0.02),
        _Draw("patch_merge_mlp.linear_1.weight", (h, 4 * h), 0.02),
        _Draw(HUB_PREFIX + "model.mtp.layers.0.enorm.weight", (h,), _NORM_STD),
        _Draw(HUB_PREFIX + "model.mtp.layers.0.eh_proj.weight", (h, 2 * h), 0.02),
    ]
    return [_one(d.name, d, dtype) for d in draws]


def checkpoint_tensors(config: M3Config, layout: str = HUB, dtype: torch.dtype | None = None) -> list[_Out]:
    """The ordered list of tensors a checkpoint of `layout` holds (keys, shapes, dtypes, where the values come from)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
    dtype = dtype or _DTYPE_NAMES[config.torch_dtype]
    pre = HUB_PREFIX if layout == HUB else ""
    c = config
    embed = _Draw("model.embed_tokens.weight", (c.vocab_size, c.hidden_size), 1.0)
    outs = [_one(pre + embed.name, embed, dtype)]
    for i in range(c.num_hidden_layers):
        outs += _layer_outs(c, i, layout, dtype)
    norm = _Draw("model.norm.weight", (c.hidden_size,), _NORM_STD)
    head = _Draw("lm_head.weight", (c.vocab_size, c.hidden_size), 1.0 / math.sqrt(c.hidden_size))
    outs += [_one(pre + norm.name, norm, dtype), _one(pre + head.name, head, dtype)]
    if layout == HUB:
        outs += _skipped_hub_outs(c, dtype)
    return outs


# ----------------------------------------------------------------------------------------------------------------
# Streaming safetensors writer.

def _split_shards(outs: list[_Out], num_shards: int) -> list[list[_Out]]:
    """Consecutive groups of roughly equal bytes; every shard gets at least one tensor."""
    num_shards = max(1, min(num_shards, len(outs)))
    total = sum(o.nbytes for o in outs)
    shards: list[list[_Out]] = [[]]
    done = 0
    for idx, out in enumerate(outs):
        left_tensors, left_shards = len(outs) - idx, num_shards - len(shards)
        full = shards[-1] and (done >= total * len(shards) / num_shards or left_tensors <= left_shards)
        if full and left_shards > 0:
            shards.append([])
        shards[-1].append(out)
        done += out.nbytes
    return shards


def _write_safetensors(path: Path, outs: list[_Out], seed: int, device: torch.device | str) -> None:
    """Write the header up front (all shapes are known), then each tensor's bytes block by block."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for o in outs:
        header[o.key] = {"dtype": _ST_DTYPES[o.dtype], "shape": list(o.shape), "data_offsets": [offset, offset + o.nbytes]}
        offset += o.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for o in outs:
            written = 0
            for draw in o.draws:
                for block in _draw_blocks(draw, seed, device):
                    data = block.to(o.dtype).cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                    f.write(data)
                    written += data.nbytes
            if written != o.nbytes:
                raise AssertionError(f"{o.key}: wrote {written} bytes, expected {o.nbytes}")


def shard_name(index: int, count: int) -> str:
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_weights(config: M3Config, out_dir: str | Path, *, seed: int = 0, layout: str = HUB, num_shards: int = 2,
                  dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> dict[str, str]:
    """Sharded safetensors + `model.safetensors.index.json`; returns the weight map (key -> file)."""
    out_dir = Path(out_dir)
    outs = checkpoint_tensors(config, layout, dtype)
    shards = _split_shards(outs, num_shards)
    weight_map: dict[str, str] = {}
    for n, group in enumerate(shards, start=1):
        name = shard_name(n, len(shards))
        _write_safetensors(out_dir / name, group, seed, device)
        weight_map.update({o.key: name for o in group})
    index = {"metadata": {"total_size": sum(o.nbytes for o in outs)}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE, special tokens at the ids the config names.

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}

# The chat template (msa/chat_template.py): the MiniMax-M3 format with these role tokens. A plain turn is
# <|role|>\n{text}<|eos|>\n after one <|bos|>; the generation prompt is <|assistant|>\n. The end-of-turn token is
# EOS itself, so a model that ends its turn stops generation.
CHAT_TEMPLATE = chat_template.CHAT_TEMPLATE

# A small mixed corpus the BPE merges are learned from: English prose, code, numbers and some non-Latin text,
# so common words become single tokens while everything else falls back to bytes.
_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A model that serves many requests at once keeps their keys and
values in pages of memory, and each new token attends to the blocks that matter most for it.
Once upon a time there was a little robot who wanted to learn how to write poems about the sea and the stars.
The weather today is sunny with a light breeze from the west; tomorrow it will rain in the morning.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are there in a week? Answer: There are seven days in a week.
def attention(query, key, value, mask=None):
    scores = query @ key.transpose(-1, -2) / math.sqrt(query.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ value

for i in range(10):
    print(f"step {i}: loss = {1.0 / (i + 1):.4f}")
{"model": "minimax-m3", "messages": [{"role": "user", "content": "Hello, how are you?"}], "stream": true}
0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 4096 65536 3.14159 2.71828 1e-6 42
Hello world! Hello there. Thank you very much. You are welcome. Good morning, good evening, good night.
Les modèles de langue écrivent du texte. Ein kleines Modell für schnelle Tests. ¿Dónde está la biblioteca?
机器学习模型可以生成文本。你好，世界！今天天气很好。 日本語のテキストも少し。 Привет, мир! Γειά σου κόσμε.
Emoji: 🙂 🚀 ✨ — "quotes", ‘single’, and the ellipsis… are all bytes in the end.
The system prompt says: you are a helpful assistant. The user asks a question, and the assistant answers it.
"""


@dataclass(frozen=True)
class SpecialTokens:
    """Ids of the tokenizer's special tokens."""

    pad_id: int
    bos_id: int
    eos_id: int
    role_ids: dict[str, int]

    def by_token(self) -> dict[str, int]:
        return {PAD: self.pad_id, BOS: self.bos_id, EOS: self.eos_id,
                **{ROLE_TOKENS[r]: i for r, i in self.role_ids.items()}}


def special_token_ids(config: M3Config) -> SpecialTokens:
    """BOS and EOS where the config says; pad and the role tokens on the next free ids of the same region
    (from 0 when BOS/EOS sit at the front of the vocab, like the tiny preset; after them otherwise, like M3)."""
    if config.bos_token_id is None or not config.eos_token_id:
        raise ValueError("bos_token_id/eos_token_id: the config must name both to build a tokenizer")
    bos, eos = int(config.bos_token_id), int(config.eos_token_id[0])
    taken = {bos, eos}
    start = 0 if min(bos, eos) < 256 else min(bos, eos)
    free = (i for i in range(start, config.vocab_size) if i not in taken)
    try:
        pad = next(free)
        roles = {r: next(free) for r in ROLE_TOKENS}
    except StopIteration:
        raise ValueError(f"vocab_size: {config.vocab_size} leaves no room for the special tokens") from None
    return SpecialTokens(pad_id=pad, bos_id=bos, eos_id=eos, role_ids=roles)


def _learned_bpe(num_tokens: int) -> tuple[list[str], list[tuple[str, str]]]:
    """Byte alphabet + merged tokens (at most `num_tokens` in all) and the ordered merges, learned on the corpus."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=num_tokens, initial_alphabet=alphabet, show_progress=False,
                                  min_frequency=2, special_tokens=[])
    tok.train_from_iterator(_TRAINING_TEXT.splitlines(keepends=True), trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"], key=model["vocab"].get)
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model["merges"]]
    return vocab, merges


def build_tokenizer(config: M3Config):
    """A `tokenizers.Tokenizer` whose vocab is exactly `config.vocab_size` ids: specials at their ids, the 256
    byte symbols and learned merges after, then unreachable filler tokens if the corpus runs out of merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    special = special_token_ids(config)
    by_token = special.by_token()
    num_regular = config.vocab_size - len(by_token)
    if num_regular < 256:
        raise ValueError(f"vocab_size: {config.vocab_size} is too small for a byte-level vocab (need >= "
                         f"{256 + len(by_token)})")
    regular, merges = _learned_bpe(num_regular)
    seen = set(regular)
    filler = (f"<unused{n}>" for n in range(config.vocab_size))
    while len(regular) < num_regular:  # never produced by encoding (no merge builds them); decode to their text
        t = next(filler)
        if t not in seen:
            regular.append(t)
    ids_of_special = {i: t for t, i in by_token.items()}
    it = iter(regular)
    vocab = {(ids_of_special[i] if i in ids_of_special else next(it)): i for i in range(config.vocab_size)}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sorted(by_token, key=by_token.get)])
    for t, i in by_token.items():
        assert tok.token_to_id(t) == i, (t, i, tok.token_to_id(t))
    assert tok.get_vocab_size(with_added_tokens=True) == config.vocab_size
    return tok, special


def write_tokenizer(config: M3Config, out_dir: str | Path) -> SpecialTokens:
    """tokenizer.json + tokenizer_config.json (chat template, special tokens), loadable by our `Tokenizer` and
    by `transformers.AutoTokenizer`."""
    out_dir = Path(out_dir)
    tok, special = build_tokenizer(config)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
                      "special": True} for t, i in sorted(special.by_token().items(), key=lambda x: x[1])}
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ROLE_TOKENS.values()),
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n")
    return special


# ----------------------------------------------------------------------------------------------------------------
# Config files.

def config_json(config: M3Config, layout: str) -> dict[str, object]:
    if layout == HUB:
        return config.to_hub_dict()
    raw = {"architectures": ["MiniMaxM3VLForCausalLM"], **config.to_hf_text_dict()}
    return raw


def write_checkpoint(config: M3Config, out_dir: str | Path, *, seed: int = 0, layout: str = HUB, num_shards: int = 2,
                     dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> Path:
    """Write a complete random checkpoint directory: config.json, generation_config.json, sharded safetensors with
    their index, tokenizer.json and tokenizer_config.json. Returns `out_dir`.

    `dtype` overrides `config.torch_dtype` for the stored weights (router weights stay fp32). `device` is where the
    random numbers are drawn (a CUDA device is much faster for big presets; values then differ from CPU draws)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: {layout!r} is not one of {LAYOUTS}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = config_json(config, layout)
    if dtype is not None:
        name = next(k for k, v in _DTYPE_NAMES.items() if v == dtype)
        text = raw["text_config"] if layout == HUB else raw
        text["torch_dtype"] = name
    write_weights(config, out_dir, seed=seed, layout=layout, num_shards=num_shards, dtype=dtype, device=device)
    special = write_tokenizer(config, out_dir)
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": list(config.eos_token_id),
           "pad_token_id": special.pad_id}
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    return out_dir


__all__ = ["write_checkpoint", "write_tokenizer", "SpecialTokens", "write_weights", "checkpoint_tensors", "config_json", "shard_name",
           "HUB", "TRANSFORMERS", "LAYOUTS", "HUB_PREFIX"]
