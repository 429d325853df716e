"""A real checkpoint whose greedy answers to a few given prompts are given texts (test helper).

Why: a random model never writes the tool-call or reasoning syntax by itself, yet the tool round trip must be shown
through the running server, with the real engine decoding real weights. So the test model is the tiny preset
widened to `HIDDEN` (room for the scripts below; the architecture and tokenizer are the tiny model's), written
by `msa.checkpoint.write_checkpoint`, and only its `lm_head` is re-fit offline: the transformers reference runs
each (prompt + answer + EOS) once, teacher-forced, and `lm_head` is trained on those final hidden states until
every next token of every script wins its argmax by `MARGIN` logits. Greedy decoding of the served checkpoint
then writes exactly the scripted answers (the engine equals transformers' greedy decoding, test_serving.py);
any other prompt gets whatever the fitted weights give. Nothing in the server knows about it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

HIDDEN = 512  # final hidden states span at most this many dimensions: the scripts' tokens must be separable
MARGIN = 8.0  # logits by which every scripted token must win (engine vs reference differ by ~1e-4)


def _config():
    from workers.models import TINY_PRESET, preset_config

    return dataclasses.replace(preset_config(TINY_PRESET), hidden_size=HIDDEN)


@torch.no_grad()
def _final_hidden(model, ids: list[int]) -> torch.Tensor:
    """The normed final hidden state at every position (what lm_head reads), from one teacher-forced pass."""
    seen: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0][0].detach()))
    try:
        model(torch.tensor([ids]))
    finally:
        hook.remove()
    return seen[0]


def _fit(features: torch.Tensor, targets: torch.Tensor, init: torch.Tensor, steps: int = 3000) -> torch.Tensor:
    """lm_head weights under which each feature row's target wins by MARGIN (a multiclass hinge, Adam)."""
    w = init.clone().requires_grad_(True)
    opt = torch.optim.Adam([w], lr=0.01)
    for _ in range(steps):
        logits = features @ w.T
        gap = logits.gather(1, targets[:, None]) - logits.scatter(1, targets[:, None], float("-inf")).amax(1,
                                                                                                           True)
        if bool((gap > MARGIN * 1.5).all()):
            break
        loss = torch.relu(MARGIN * 2 - gap).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    w = w.detach()
    logits = features @ w.T
    gap = logits.gather(1, targets[:, None]) - logits.scatter(1, targets[:, None], float("-inf")).amax(1, True)
    if not bool((gap > MARGIN).all()):
        raise RuntimeError(f"lm_head fit: {(gap <= MARGIN).sum().item()} of {len(targets)} scripted tokens do not "
                           f"win by {MARGIN} (smallest gap {gap.min().item():.2f})")
    return w


def write_scripted_checkpoint(out_dir: Path, scripts: list[tuple[list[int], list[int]]]) -> Path:
    """A hub-layout checkpoint in `out_dir` whose greedy continuation of each script's prompt ids is its answer
    ids then EOS. Raises RuntimeError if the scripts cannot all be fitted."""
    from safetensors.torch import load_file, save_file
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    from msa.checkpoint import HUB, TRANSFORMERS, write_checkpoint

    config = _config()
    eos = config.eos_token_id[0]
    hub = write_checkpoint(config, out_dir / "served", seed=0, layout=HUB)
    ref_dir = write_checkpoint(config, out_dir / "reference", seed=0, layout=TRANSFORMERS)  # same weights
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes on a shared 2-core box: one thread is far faster
    try:
        model = MiniMaxM3VLForCausalLM.from_pretrained(ref_dir, attn_implementation="eager",
                                                       dtype=torch.float32).eval()
        feats, targets = [], []
        for prompt, answer in scripts:
            ids = list(prompt) + list(answer) + [eos]
            h = _final_hidden(model, ids[:-1])
            feats.append(h[len(prompt) - 1:])
            targets += ids[len(prompt):]
        w = _fit(torch.cat(feats), torch.tensor(targets), model.lm_head.weight.detach())
    finally:
        torch.set_num_threads(threads)
    key = "language_model.lm_head.weight"
    index = json.loads((hub / "model.safetensors.index.json").read_text())
    shard = hub / index["weight_map"][key]
    tensors = load_file(shard)
    assert tensors[key].shape == w.shape, (tensors[key].shape, w.shape)
    tensors[key] = w.to(tensors[key].dtype).contiguous()
    save_file(tensors, shard, metadata={"format": "pt"})
    return hub
