"""Prefill/decode disaggregation end to end: real Ray Serve on loopback, one prefill and one decode replica of
the built-in tiny model, KV pages moved over gloo (tests/deploy/pdapp.py). Greedy outputs equal the unified app
and transformers; the client sees one ordinary stream; stats come out labelled by role."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest
import torch

from tests.deploy.pdapp import greedy_completions, handle, pages_in_use, pd_app

# mixed lengths, most past 64 tokens so the sparse layers select 4 of up to 12 blocks
LENGTHS = [4, 19, 40, 64, 66, 70, 81, 90, 97, 105, 120, 128, 133, 150, 170, 190]
MAX_TOKENS = [6, 3, 8, 5, 7, 2, 8, 4, 6, 8, 3, 7, 5, 8, 4, 6]


@pytest.fixture(scope="module")
def pd(serve_app):
    return pd_app(serve_app)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 384) for _ in range(n)] for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(serve_app, prompts, tmp_path_factory):
    """Per prompt alone, transformers greedy: tokens and the log_softmax of the raw logits at each step."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    from workers.models import TINY_PRESET, write_preset_checkpoint

    path = write_preset_checkpoint(TINY_PRESET, tmp_path_factory.mktemp("pd-ref") / "tiny", seed=0,
                                   layout="transformers")
    model = MiniMaxM3VLForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = []
        for ids, k in zip(prompts, MAX_TOKENS):
            with torch.no_grad():
                g = model.generate(torch.tensor([ids]), max_new_tokens=k, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True, eos_token_id=None)
            out.append((g.sequences[0, len(ids):].tolist(), [torch.log_softmax(l[0].float(), -1) for l in g.logits]))
        return out
    finally:
        torch.set_num_threads(threads)


def completions(app, prompts):
    return greedy_completions(app, prompts, MAX_TOKENS)


def test_sixteen_concurrent_greedy_requests_equal_unified_and_transformers(pd, serve_app, prompts, reference):
    handle("Router").pop_request_stats.remote().result()  # start from a clean slate
    got = asyncio.run(completions(pd, prompts))
    unified = asyncio.run(completions(serve_app, prompts))
    for r, (resp, uresp, (toks, lps)) in enumerate(zip(got, unified, reference)):
        c, u = resp.choices[0], uresp.choices[0]
        where = f"prompt {r} ({LENGTHS[r]} tokens)"
        assert c.model_extra["token_ids"] == toks == u.model_extra["token_ids"], where
        assert c.text == u.text and c.finish_reason == u.finish_reason == "length", where
        assert len(c.logprobs.top_logprobs) == len(toks), where
        for pos, (top, utop, want) in enumerate(zip(c.logprobs.top_logprobs, u.logprobs.top_logprobs, lps)):
            # top-5 values vs transformers and unified. The tiny tokenizer decodes several ids to one string (one
            # key of OpenAI's dict), so each value shown must be one of transformers' top 5; the chosen token's
            # logprob is checked exactly below (the in-process role test compares the top-5 dicts by token id)
            values = sorted(top.values(), reverse=True)
            ref = torch.topk(want, 5).values.tolist()
            assert 1 <= len(values) <= 5, f"{where} pos {pos}"
            assert all(min(abs(v - r) for r in ref) <= 1e-4 for v in values), f"{where} pos {pos}"
            assert values == pytest.approx(sorted(utop.values(), reverse=True), abs=1e-5), f"{where} pos {pos}"
            assert c.logprobs.token_logprobs[pos] == pytest.approx(float(want[toks[pos]]), abs=1e-4)
    rows = pd.wait_idle()
    assert {r["role"] for r in rows} == {"prefill", "decode"}
    assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}
    # role-labelled request stats: every request on prefill, the ones with more than one token on decode too
    stats = handle("Router").pop_request_stats.remote().result()
    by_role = {}
    for s in stats:
        by_role.setdefault(s.role, []).append(s)
    assert len(by_role["prefill"]) == 16 and len(by_role["decode"]) == sum(k > 1 for k in MAX_TOKENS)
    assert all(s.finished_reason == "handoff" and s.queue_time is not None for s in by_role["prefill"])
    assert all(s.finished_reason == "length" and s.queue_time is not None and s.failure_reason is None
               for s in by_role["decode"])
    assert sorted(s.generation_tokens for s in by_role["decode"]) == sorted(k for k in MAX_TOKENS if k > 1)


def test_one_stream_starts_with_the_first_token(pd, prompts, reference):
    """One SSE stream: the first event starts with the token prefill sampled (the decode replica streams it from
    the KV header; a later one may ride along when a hop lagged), and together they are the greedy tokens."""
    body = {"model": pd.model, "prompt": prompts[9], "max_tokens": MAX_TOKENS[9], "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    with httpx.stream("POST", f"{pd.base_url}/v1/completions", json=body, headers=pd.headers, timeout=60) as r:
        assert r.status_code == 200
        text = r.read().decode()
    events = [json.loads(b[len("data: "):]) for b in text.strip().split("\n\n") if b != "data: [DONE]"]
    ids = [e["choices"][0].get("token_ids") or [] for e in events if e["choices"]]
    assert ids[0][:1] == reference[9][0][:1]
    assert sum(ids, []) == reference[9][0]
    assert text.rstrip().endswith("data: [DONE]")
    pd.wait_idle()


def _usable_stop(text: str, start: int) -> str | None:
    """A 2-character stop string of `text` first occurring at or after `start` (no replacement characters)."""
    for a in range(start, len(text) - 1):
        s = text[a:a + 2]
        if "\ufffd" not in s and s.strip() and text.find(s) == a:
            return s
    return None


def test_stop_strings_stop_the_decode_or_the_prefill(pd, prompts):
    """The ingress makes the text of a disaggregated stream too: a stop string after the first token, or inside
    the first token's text (the decode replica's stream carries that token too), stops the request on the decode
    replica (finished "stop" there, counted finished). The text ends before the stop string and no page stays
    in use. (A first token that comes through the router, as after a retried prefill, is aborted through the
    router instead: tests/deploy/test_output.py.)"""
    client = pd.client()
    kw = dict(model=pd.model, temperature=0, extra_body={"ignore_eos": True, "return_token_ids": True})
    handle("Router").pop_request_stats.remote().result()
    seen_first = seen_later = False
    for ids in prompts:
        full = client.completions.create(prompt=ids, max_tokens=16, **kw).choices[0]
        first_text = pd_decode(full.model_extra["token_ids"][:1])
        later = _usable_stop(full.text, len(first_text) + 1)
        in_first = _usable_stop(first_text, 0) if len(first_text) >= 2 else None
        for stop, which in ((later, "later"), (in_first, "first")):
            if stop is None:
                continue
            for stream in (False, True):
                if stream:
                    chunks = list(client.completions.create(prompt=ids, max_tokens=300, stop=[stop], stream=True, **kw))
                    text = "".join(c.choices[0].text for c in chunks if c.choices)
                    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                else:
                    choice = client.completions.create(prompt=ids, max_tokens=300, stop=[stop], **kw).choices[0]
                    text, reasons = choice.text, [choice.finish_reason]
                assert text == full.text[:full.text.find(stop)] and reasons == ["stop"], (which, stop, full.text)
            seen_first |= which == "first"
            seen_later |= which == "later"
        pd.wait_idle()
        assert pages_in_use(pd) == {"prefill-0": 0, "decode-0": 0}
        if seen_first and seen_later:
            break
    assert seen_later and seen_first, "no prompt gave usable stop strings (after / inside the first token)"
    decode = [s for s in handle("Router").pop_request_stats.remote().result() if s.role == "decode"]
    assert sum(s.finished_reason == "stop" for s in decode) >= 4  # both kinds, streamed and not, stopped there
    assert all(r["counters"]["aborted"] == 0 for r in pd.engine_stats())


def pd_decode(ids: list[int]) -> str:
    from workers.models import tiny_model_dir
    from workers.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_model_dir()).decode(ids)


def test_transfer_stats_reach_the_reporter(pd):
    """The prefill replica's EngineReporter drains `pop_transfer_stats` (bytes, seconds per transfer)."""
    prefill = handle("EngineServer-prefill-0")
    before = prefill.transfer_totals.remote().result()
    client = pd.client()
    client.completions.create(model=pd.model, prompt=list(range(3, 103)), max_tokens=3, temperature=0)
    pd.wait_idle()
    after = prefill.transfer_totals.remote().result()
    per_page = 16 * 4 * (4 * 2 * 2 * 32 + 3 * 32)  # tiny model: 4 layers of K+V (2 heads x 32) + 3 index-K
    assert after["transfers"] == before["transfers"] + 1
    assert after["bytes"] - before["bytes"] == 7 * per_page  # 100 prompt tokens = 7 pages
    assert after["seconds"] > before["seconds"]


def test_serve_cli_disaggregate_flags():
    """`m3serve serve --disaggregate ...` flags become the prefill/decode groups and transfer settings."""
    import argparse

    from deploy.app import config_from_args
    from deploy.config import ConfigError
    from deploy.serve_cmd import add_arguments, overrides_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--disaggregate", "--prefill-replicas", "2", "--decode-replicas", "3",
                              "--prefill-tp", "2", "--decode-dp", "2", "--transfer-timeout", "7",
                              "--transfer-lease", "9", "--retry-prefill", "--admit-wait", "2.5"])
    cfg = config_from_args({"overrides": overrides_from_args(args)})
    groups = cfg.groups()
    assert cfg.disaggregate and set(groups) == {"prefill", "decode"}
    assert (groups["prefill"].replicas, groups["prefill"].tp, groups["decode"].replicas, groups["decode"].dp) == (2, 2, 3, 2)
    assert (cfg.transfer.timeout_s, cfg.transfer.lease_s, cfg.transfer.retry_prefill,
            cfg.transfer.admit_wait_s) == (7.0, 9.0, True, 2.5)
    with pytest.raises(ConfigError, match="admit_wait_s"):
        config_from_args({"overrides": overrides_from_args(parser.parse_args(["--admit-wait", "-1"]))})
    preset = config_from_args({"config_file": "configs/serve/cpu-pd.yaml"})
    assert preset.disaggregate and preset.device == "cpu" and set(preset.groups()) == {"prefill", "decode"}
    assert overrides_from_args(parser.parse_args([])) == {}
    # the GPU data plane: our own NCCL calls unless told "torch" (ProcessGroupNCCL). The `transfer` section is
    # the engines' own TransferConfig (one definition), so it reaches them as it is; the timeouts a serve config
    # does not name follow its lease and transfer timeout
    from workers.kv.config import TransferConfig

    gpu = config_from_args({"config_file": "configs/serve/gpu-2-pd.yaml"})
    assert type(gpu.transfer) is TransferConfig and gpu.transfer.nccl == "direct"
    assert (cfg.transfer.receive_timeout_s, cfg.transfer.connect_timeout_s) == (9.0, 30.0)
    # per-role chunk size: the GPU preset's prefill group steps 16k tokens, its decode group the engine's 8k
    assert (gpu.engine_for("prefill").max_num_batched_tokens, gpu.engine_for("decode").max_num_batched_tokens,
            gpu.engine.max_num_batched_tokens) == (16384, 8192, 8192)
    assert gpu.engine_for("prefill").max_model_len == gpu.engine.max_model_len
    with pytest.raises(ConfigError, match="prefill: max_num_batched_tokens: must be >= 1"):
        config_from_args({"overrides": {"prefill": {"max_num_batched_tokens": 0}}})
    torch_pg = config_from_args({"overrides": {"transfer": {"nccl": "torch"}}})
    assert torch_pg.transfer.nccl == "torch"
    with pytest.raises(ConfigError, match="transfer.nccl: must be one of"):
        config_from_args({"overrides": {"transfer": {"nccl": "mpi"}}})


def test_serve_cli_prefill_dp():
    """`--prefill-dp 2` (attention DP on the prefill side, docs/disaggregation.md) is a valid disaggregated
    layout, also with EP across its dp ranks; a layout that cannot be built is refused naming the field."""
    import argparse

    from deploy.app import config_from_args
    from deploy.config import ConfigError
    from deploy.serve_cmd import add_arguments, overrides_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def load(*flags: str):
        return config_from_args({"overrides": overrides_from_args(parser.parse_args(["--disaggregate", *flags]))})

    prefill = load("--prefill-dp", "2").groups()["prefill"]
    assert (prefill.tp, prefill.dp, prefill.ep, prefill.parallel.world_size) == (1, 2, 1, 2)
    both = load("--prefill-dp", "2", "--prefill-ep", "2", "--decode-dp", "2").groups()
    assert (both["prefill"].parallel.dp, both["prefill"].parallel.ep, both["decode"].parallel.dp) == (2, 2, 2)
    with pytest.raises(ConfigError, match=r"prefill: ep: 3 must divide tp \* dp = 2"):
        load("--prefill-dp", "2", "--prefill-ep", "3")
    with pytest.raises(ConfigError, match="prefill: dp: must be >= 1, got 0"):
        load("--prefill-dp", "0")
