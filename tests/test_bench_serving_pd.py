"""CPU smoke run of benchmarks/bench_serving_pd.py: the tiny model served unified and disaggregated through real
Ray Serve (and driven in-process), the short + long workload through deploy.bench, the numbers and the KV
transfer accounting checked, and the diagnosis built from the client traces and the replicas' timelines.

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
    return json.loads(out.read_text()), proc.stdout, json.loads(out.with_name("result.trace.json").read_text())


def test_every_mode_completes_every_request(tiny_run):
    res, stdout, _ = tiny_run
    w = res["workload"]
    assert res["errors"] == [] and res["supervisor"]["timed_out"] is False
    # the front `m3serve serve` picks by default (auto: HAProxy, which ray[serve] installs here), said in the table
    assert res["http_proxy"] == "haproxy" and "HTTP front: haproxy" in stdout
    for mode in ("unified", "pd", "inproc"):
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
    res, _, _ = tiny_run
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

    res, _, _ = tiny_run
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
    res, stdout, _ = tiny_run
    lines = stdout.strip().splitlines()
    assert lines[-1].startswith("=") and "goal (PERF.md)" in lines[-2]
    rows = {ln.split()[0]: ln for ln in lines if ln.split() and ln.split()[0] in ("unified", "pd")}
    assert set(rows) == {"unified", "pd"}
    pd = res["modes"]["pd"]["summary"]
    assert f"{pd['ratio_p99_to_decode_only_p50']:.2f}x" in rows["pd"]
    assert f"{pd['kv_transfers']} / " in rows["pd"]


def test_diagnosis_of_every_measured_phase(tiny_run):
    res, stdout, traces = tiny_run
    w = res["workload"]
    for mode in ("unified", "pd", "inproc"):
        for phase in ("decode_only", "mixed"):
            ph = res["modes"][mode][phase]
            assert "trace" not in ph and "trace_error" not in ph and "diagnosis_error" not in ph, ph.keys()
            trace = traces[mode][phase]
            assert len(trace["short"]) == w["num_short"] and all(r["id"] and r["ok"] for r in trace["short"])
            assert all(sum(r["n"]) == w["short_output_len"] for r in trace["short"])
            diag = ph["diagnosis"]
            # a first -> second token gap exists where the first chunk carried the first token alone; on a loaded
            # machine the stream may fall behind and merge the first two (then that request has no such gap)
            alone = sum(1 for r in trace["short"] if len(r["n"]) > 1 and r["n"][0] == 1)
            assert alone >= w["num_short"] // 2, [r["n"] for r in trace["short"]]
            assert diag["gaps"]["first_gap_ms"]["n"] == alone
            assert len(diag["worst"]) == 3 and all(g["gap_ms"] > 0 for x in diag["worst"] for g in x["gaps"])
            assert diag["steps"]["n"] > 0 and 0 <= diag["steps"]["not_forward_fraction"] <= 1
            assert diag["serve_hops"]["step_to_client_ms"]["n"] > 0
            # every such first -> second token gap split, and its pieces add up to it
            split = diag["first_gap_split"]
            assert split["n"] == alone
            for r in split["requests"]:
                seg = r["segments_ms"]
                parts = sum(v for k, v in seg.items() if k not in ("first_token_hop", "landed_to_activated",
                                                                   "activated_to_step_end"))
                assert abs(parts - seg["first_token_hop"] - r["gap_ms"]) < 0.1, r
            if phase == "mixed":
                assert [x["i"] for x in diag["long"]] == list(range(w["num_long"]))
        servers = set(traces[mode]["mixed"]["server"])
        assert servers == {"pd": {"prefill-0", "decode-0"}, "unified": {"unified-0"}, "inproc": {"inproc"}}[mode]
    pd = res["modes"]["pd"]["mixed"]["diagnosis"]
    assert {"transfer", "landed_to_decode_step", "decode_step_to_client"} <= set(pd["first_gap_split"]["summary"])
    assert pd["prefill_steps"]["n"] > 0 and all("kv_landed_s" in x for x in pd["long"])
    assert set(res["serve_vs_inproc"]) == {"unified", "pd"}
    # the few lines per mode and phase come before the table
    diag_at = stdout.index("where the time goes")
    assert diag_at < stdout.index("[pd] mixed") < stdout.index("TPOT dec-only p50/p99")
    assert "Serve path vs in-process engine" in stdout
