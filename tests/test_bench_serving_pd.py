"""CPU smoke run of benchmarks/bench_serving_pd.py: the tiny model served unified and disaggregated through real
Ray Serve, the short + long workload through deploy.bench, the numbers and the KV transfer accounting checked.

The script starts its own local Ray instance, so it runs as a subprocess (never beside another Ray in this
process)."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_serving_pd.py"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_pd") / "result.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(out.read_text()), proc.stdout


def test_both_modes_complete_every_request(tiny_run):
    res, _ = tiny_run
    w = res["workload"]
    assert res["errors"] == [] and res["supervisor"]["timed_out"] is False
    for mode in ("unified", "pd"):
        doc = res["modes"][mode]
        assert doc["warmup"]["failed"] == 0, doc["warmup"]
        for phase, num_long in (("decode_only", 0), ("mixed", w["num_long"])):
            short, long = doc[phase]["short"], doc[phase]["long"]
            assert short["completed"] == w["num_short"] and short["failed"] == 0, (mode, phase, doc[phase])
            # ignore_eos pins every output length: the server's usage says how many tokens came back
            assert short["total_output_tokens"] == w["num_short"] * w["short_output_len"]
            assert short["total_input_tokens"] == w["num_short"] * w["short_input_len"]
            assert long["completed"] == num_long and long["failed"] == 0
            # TTFT, then TPOT (>= 2 tokens) and ITL measured on the client, in order of size that must hold
            assert 0 < short["median_ttft_ms"] <= short["p99_ttft_ms"]
            assert 0 < short["median_tpot_ms"] <= short["p99_tpot_ms"]
            assert 0 < short["median_itl_ms"] <= short["p99_itl_ms"]
        if w["num_long"]:
            assert doc["mixed"]["long"]["total_input_tokens"] == w["num_long"] * w["long_input_len"]
            assert doc["mixed"]["long"]["median_ttft_ms"] > 0
            sent = doc["mixed"]["long_sent_at_s"]
            assert len(sent) == w["num_long"] and sent == sorted(sent) and sent[0] > 0


def test_summary_ratio_is_computed_from_the_phases(tiny_run):
    res, _ = tiny_run
    for mode in ("unified", "pd"):
        doc = res["modes"][mode]
        s = doc["summary"]
        assert s["failed"] == 0
        assert s["decode_only_tpot_p50_ms"] == doc["decode_only"]["short"]["median_tpot_ms"]
        assert s["mixed_tpot_p99_ms"] == doc["mixed"]["short"]["p99_tpot_ms"]
        assert math.isclose(s["ratio_p99_to_decode_only_p50"],
                            s["mixed_tpot_p99_ms"] / s["decode_only_tpot_p50_ms"], rel_tol=1e-12)


def test_kv_transfers_one_per_request_with_exact_bytes(tiny_run):
    import torch

    from msa.kv_cache import KVCache
    from workers.models import preset_config

    res, _ = tiny_run
    w = res["workload"]
    config = preset_config("tiny")
    per_page = KVCache.bytes_per_page(config, torch.float32)  # CPU engines run the tiny model in fp32
    pages = lambda tokens: math.ceil(tokens / config.page_size)  # noqa: E731
    assert res["modes"]["unified"]["decode_only"]["kv_transfers"] is None  # nothing moves when unified
    pd = res["modes"]["pd"]
    expect = {"decode_only": w["num_short"] * pages(w["short_input_len"]),
              "mixed": w["num_short"] * pages(w["short_input_len"]) + w["num_long"] * pages(w["long_input_len"])}
    for phase, num_pages in expect.items():
        kv = pd[phase]["kv_transfers"]
        num_requests = w["num_short"] + (w["num_long"] if phase == "mixed" else 0)
        assert kv["transfers"] == num_requests and kv["failed"] == 0, (phase, kv)
        assert kv["bytes"] == num_pages * per_page, (phase, kv)  # whole prompt pages, every layer and family
        assert kv["seconds"] > 0
    assert pd["summary"]["kv_transfers"] == w["num_short"] + w["num_long"]
    # no page left in use on any engine after the run
    for row in pd["engine_stats"]:
        assert row["stats"]["num_pages_free"] == row["stats"]["num_pages_total"], row


def test_table_is_printed_last(tiny_run):
    res, stdout = tiny_run
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("=") and "goal (PERF.md)" in lines[-2]
    rows = {ln.split()[0]: ln for ln in lines if ln.split() and ln.split()[0] in ("unified", "pd")}
    assert set(rows) == {"unified", "pd"}
    pd = res["modes"]["pd"]["summary"]
    assert f"{pd['ratio_p99_to_decode_only_p50']:.2f}x" in rows["pd"]
    assert f"{pd['kv_transfers']} / " in rows["pd"]
