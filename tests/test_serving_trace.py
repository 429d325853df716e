"""benchmarks/serving_trace.py and the pure parts of bench_serving_pd.py on made-up traces: where gaps are, what
overlapped them, the first -> second token split (its pieces add up to the gap), the step-time accounting, and
the Serve-vs-in-process comparison. Times are exact binary fractions where sums are compared."""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))
import serving_drivers as drivers  # noqa: E402
import serving_report as report  # noqa: E402
import serving_trace as st  # noqa: E402

T0 = 1_000.0  # the run's start, time.time(); replica timelines are absolute, client traces relative
FIELDS = ("start", "end", "prefill_tokens", "decode_tokens", "batch_size", "forward_s", "host_s", "idle_s",
          "inbox_s", "publish_s", "tokens")


def step(start, end, *, prefill=0, decode=1, batch=1, forward=None, host=None, idle=0.0, inbox=0.0, publish=0.0,
         tokens=()):
    """A timeline step row (absolute times) as AsyncEngine.debug_timeline returns it."""
    dur = end - start
    forward = dur / 2 if forward is None else forward
    host = dur - forward if host is None else host
    return [T0 + start, T0 + end, prefill, decode, batch, forward, host, idle, inbox, publish,
            [list(t) for t in tokens]]


def timeline(steps=(), marks=(), serve=(), role="decode"):
    return {"role": role, "step_fields": list(FIELDS), "steps": list(steps),
            "marks": [[T0 + t, kind, rid, {k: T0 + v for k, v in (ph or {}).items()} or None]
                      for t, kind, rid, ph in marks],
            "serve_marks": [[T0 + t, rid, kind, n] for t, rid, kind, n in serve]}


def req(rid, t, *, start=0.0, n=None, ok=True):
    n = n or [1] * len(t)
    return {"id": rid, "ok": ok, "start": start, "end": t[-1], "t": list(t), "n": n, "out": sum(n)}


def test_chunk_gaps_index_tokens_not_chunks():
    r = req("a", [0.5, 0.75, 1.0, 1.5], n=[1, 2, 1, 1])
    gaps = st.chunk_gaps(r)
    assert [g["index"] for g in gaps] == [1, 3, 4]  # the second chunk brought tokens 1 and 2
    assert [g["gap_s"] for g in gaps] == [0.25, 0.25, 0.5]
    assert (gaps[2]["from_s"], gaps[2]["to_s"]) == (1.0, 1.5)


def test_first_gap_apart_from_later_itls():
    reqs = [req("a", [0.0, 0.5, 0.625, 0.75]), req("b", [0.0, 0.25, 0.375]), req("c", [0.0, 9.0], ok=False)]
    d = st.gap_distributions(reqs)
    assert d["first_gap_ms"]["n"] == 2 and d["first_gap_ms"]["max"] == 500.0 and d["first_gap_ms"]["p50"] == 375.0
    assert d["later_itl_ms"] == {"n": 3, "p50": 125.0, "p90": 125.0, "p99": 125.0, "max": 125.0, "mean": 125.0}


def test_worst_requests_locate_their_gaps_against_long_prompts_and_steps():
    short = [req("fast", [0.5, 0.53, 0.56]), req("slow", [0.5, 0.75, 0.78, 1.5, 1.53])]
    longs = [req("L0", [1.25, 2.0], start=0.625), req("L1", [3.0], start=2.5)]
    replica = st.Replica(timeline(steps=[step(0.4, 0.45), step(0.8, 1.4, prefill=1792, batch=3)],
                                  marks=[(1.0, "landed", "L0", {"landed": 0.9})]), T0)
    worst = st.worst_requests(short, n=1, top_gaps=2, longs=longs, replica=replica, handoff=True)
    assert [w["id"] for w in worst] == ["slow"]
    assert worst[0]["tpot_ms"] == pytest.approx(1e3 * (1.53 - 0.5) / 4)
    big, second = worst[0]["gaps"]
    # token 3 came 720 ms after token 2, while L0 was prefilling and its KV landed, over one 600 ms step
    assert big["index"] == 3 and big["gap_ms"] == 720.0 and big["at_s"] == 1.5
    assert big["long_prefilling"] == [0] and big["long_kv_landed"] == [0] and "handoff" not in big
    assert big["steps"] == 1 and big["max_step_ms"] == 600.0 and big["max_step_prefill_tokens"] == 1792
    assert second["index"] == 1 and second["handoff"] is True and second["steps"] == 0  # nothing ran: not the engine


def test_handoff_split_adds_up_to_the_client_gap():
    rid = "r"
    prefill = st.Replica(timeline(
        role="prefill",
        steps=[step(1.0, 1.25, prefill=128, tokens=[(rid, 1)])],
        marks=[(1.125, "send", rid, None), (1.4375, "settled", rid, {"called": 1.125, "posted": 1.15, "acked": 1.3})],
        serve=[(1.26, rid, "chunk", 1), (1.45, rid, "outcome", 0)]), T0)
    decode = st.Replica(timeline(
        steps=[step(1.5, 1.5625, tokens=[(rid, 1), (rid, 2)])],
        marks=[(0.9, "admitted", rid, None), (1.3125, "landed", rid, {"landed": 1.28125}),
               (1.46, "first_known", rid, None), (1.5, "activated", rid, None)],
        serve=[(1.47, rid, "decode", 0), (1.578125, rid, "chunk", 1)]), T0)
    r = req(rid, [1.265625, 1.59375, 1.625], start=0.9)
    split = st.handoff_split(r, prefill=prefill, decode=decode)
    seg = split["segments_ms"]
    assert seg["step_end_to_send"] == -125.0  # sent inside the step that finished the prompt
    assert seg["transfer"] == 156.25 and seg["landed_to_decode_step"] == 281.25
    assert seg["landed_to_activated"] == 218.75 and seg["activated_to_step_end"] == 62.5
    assert seg["decode_step_to_client"] == 31.25 and seg["first_token_hop"] == 15.62
    total = sum(v for k, v in seg.items() if k in ("step_end_to_send", "transfer", "landed_to_decode_step",
                                                   "decode_step_to_client")) - seg["first_token_hop"]
    assert total == pytest.approx(split["gap_ms"], abs=0.02) and split["gap_ms"] == pytest.approx(328.12, abs=0.01)
    ev = split["events_ms"]  # relative to the prefill step's end
    assert ev["acked"] == 50.0 and ev["outcome_left"] == 200.0 and ev["decode_called"] == 220.0
    assert ev["token2_left"] == pytest.approx(328.12, abs=0.01)
    # the client's first token came through the router (decode sent one of its two tokens): its hop is the prefill's
    first_two = req(rid, [1.265625, 1.59375], start=0.9)
    assert decode.tokens_before(first_two) == 1
    hops = st.serve_hops([first_two], decode)
    assert hops["engine_to_server_ms"]["p50"] == 15.62 and hops["server_to_client_ms"]["p50"] == 15.62
    assert hops["engine_to_server_ms"]["n"] == 1
    # a decode stream that carried the first token too: every chunk is the decode replica's
    direct = st.Replica(timeline(steps=[step(1.5, 1.5625, tokens=[(rid, 1), (rid, 2)])],
                                 serve=[(1.5703125, rid, "chunk", 2)]), T0)
    both = req(rid, [1.59375], n=[2], start=0.9)
    assert direct.tokens_before(both) == 0
    hops = st.serve_hops([both], direct)
    assert hops["engine_to_server_ms"]["p50"] == 7.81 and hops["server_to_client_ms"]["p50"] == 23.44


def test_unified_split_and_missing_pieces():
    rid = "u"
    uni = st.Replica(timeline(role="unified", steps=[step(0.0, 0.25, prefill=16, tokens=[(rid, 1)]),
                                                     step(0.25, 0.375, tokens=[(rid, 2)])]), T0)
    r = req(rid, [0.3125, 0.4375])
    seg = st.handoff_split(r, unified=uni)["segments_ms"]
    assert seg == {"engine": 125.0, "decode_step_to_client": 62.5, "first_token_hop": 62.5}
    assert st.handoff_split(req(rid, [0.3125, 0.4375], n=[2, 1]), unified=uni) is None  # token 2 rode with 1
    assert st.handoff_split(req("other", [0.3, 0.4]), unified=uni) is None


def test_step_summary_splits_busy_wall_time():
    steps = st.Replica(timeline(steps=[
        step(0.0, 0.25, forward=0.125, host=0.125, publish=0.5),  # before the phase: not counted
        step(0.5, 0.75, prefill=64, forward=0.1875, host=0.0625, idle=0.0625, inbox=0.0625, publish=0.0625),
        step(2.0, 2.25, forward=0.125, host=0.125, idle=1.0, publish=0.0625),
    ]), T0).steps
    s = st.step_summary(steps)
    assert s["wall"] == {"span_s": 2.25, "idle_s": 1.0625, "busy_s": 1.1875}
    bf = s["busy_fraction"]
    assert math.isclose(sum(bf.values()), 1.0, abs_tol=1e-3)
    assert bf["forward"] == round(0.4375 / 1.1875, 4) and bf["publish"] == round(0.125 / 1.1875, 4)
    assert s["not_forward_fraction"] == round(1 - 0.4375 / 1.1875, 4)
    assert s["decode_only_step_ms"]["n"] == 2 and s["with_prefill_step_ms"]["n"] == 1


def test_diagnose_phase_end_to_end_is_json_and_prints_a_few_lines():
    rid = "r"
    trace = {"t0": T0, "short": [req(rid, [0.0625, 0.125, 0.1875])], "long": [req("L", [0.5], start=0.0)]}
    server = {"unified-0": timeline(role="unified", steps=[step(0.0, 0.03125, tokens=[(rid, 1)]),
                                                           step(0.0625, 0.09375, tokens=[(rid, 2)]),
                                                           step(0.125, 0.15625, tokens=[(rid, 3)])],
                                    serve=[(0.04, rid, "chunk", 1), (0.1, rid, "chunk", 1), (0.16, rid, "chunk", 1)])}
    diag = st.diagnose_phase(trace, server)
    json.dumps(diag)
    assert diag["first_gap_split"]["n"] == 1 and diag["steps"]["n"] == 3 and diag["long"][0]["first_token_s"] == 0.5
    assert diag["serve_hops"]["step_to_client_ms"]["n"] == 3
    lines = st.format_phase("[unified] mixed", {"median_tpot_ms": 62.5, "p99_tpot_ms": 62.5}, diag)
    assert 3 <= len(lines) <= 6 and lines[0].startswith("[unified] mixed") and "1st->2nd" in lines[0]
    assert "in 0, n 3)" in lines[1], lines[1]  # how many steps had prefill rows: none of the three
    # no server timeline (fetch failed): the client side alone
    alone = st.diagnose_phase(trace, None)
    assert alone["worst"][0]["id"] == rid and "steps" not in alone


def test_gc_summary_matches_slow_steps_with_collections():
    tl = timeline(role="unified", steps=[step(0.0, 0.004), step(0.004, 0.03125), step(0.0625, 0.09375),
                                         step(0.125, 0.128)])
    tl["gc"] = [[T0 + 0.01, 0.015, 2, 100], [T0 + 0.1, 0.001, 0, 5], [T0 + 5.0, 0.5, 2, 9]]  # the last: after
    rep = st.Replica(tl, T0)
    got = st.gc_summary(rep)
    assert (got["n"], got["gen2"], got["slow_steps"], got["slow_with_gc"]) == (2, 1, 2, 1)
    assert math.isclose(got["max_ms"], 15.0) and math.isclose(got["total_ms"], 16.0)
    assert got["slow_with_tick"] is None  # no metrics ticks recorded (an older tree): unknown, not 0
    # the metrics reporter's ticks: one inside the second slow step, one between steps, one after the run
    tl["metrics_ticks"] = [[T0 + 0.07, 0.002, 0.001], [T0 + 0.1, 0.01, 0.003], [T0 + 9.0, 0.5, 0.4]]
    got = st.gc_summary(st.Replica(tl, T0))
    assert (got["ticks"], got["slow_with_tick"]) == (2, 1) and math.isclose(got["tick_max_ms"], 10.0)
    assert math.isclose(got["tick_cpu_max_ms"], 3.0)
    del tl["metrics_ticks"]
    del tl["gc"]  # a replica that records none (older tree, in-process engine): no summary, no line
    assert st.gc_summary(st.Replica(tl, T0)) is None
    trace = {"t0": T0, "short": [req("r", [0.0625, 0.125])]}
    lines = st.format_phase("[unified] mixed", {}, st.diagnose_phase(trace, {"unified-0": {**tl, "gc": []}}))
    assert any(line.strip().startswith("gc: 0 collections") and "steps over 10 ms 2" in line for line in lines)


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serving_pd_under_test", BENCH / "bench_serving_pd.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_client_trace_and_split_traces(bench):
    r = drivers.TracedResult(success=True, start=10.0, end=10.5, chunk_times=[10.25, 10.5], chunk_tokens=[1, 3],
                           output_tokens=4, request_id="cmpl-x-0")
    assert drivers.client_trace([r], 10.0) == [{"id": "cmpl-x-0", "ok": True, "start": 0.0, "end": 0.5,
                                              "t": [0.25, 0.5], "n": [1, 3], "out": 4}]
    results = {"modes": {"pd": {"decode_only": {"trace": {"t0": 1}, "short": {}}, "mixed": {"short": {}}}}}
    assert bench.split_traces(results) == {"pd": {"decode_only": {"t0": 1}}}
    assert "trace" not in results["modes"]["pd"]["decode_only"]


def test_serve_vs_inproc():
    def mode(tpot, step_p50):
        return {"summary": {"decode_only_tpot_p50_ms": tpot},
                "decode_only": {"diagnosis": {"steps": {"step_ms": {"p50": step_p50}}}}}
    results = {"modes": {"unified": mode(30.0, 6.0), "inproc": mode(24.0, 5.0)}}
    out = report.serve_vs_inproc(results)
    assert set(out) == {"unified"} and out["unified"]["overhead"] == pytest.approx(0.25)
    assert out["unified"]["step_p50_ms"] == 6.0 and out["unified"]["inproc_step_p50_ms"] == 5.0
    assert report.serve_vs_inproc({"modes": {"unified": mode(30.0, 6.0)}}) == {}
