"""`m3serve bench`: the measurement definitions on known timestamps, the workload, and whole runs against a
small real OpenAI-shaped streaming server on loopback (a test peer for the client only)."""
from __future__ import annotations

import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from deploy import bench
from deploy.bench import RequestResult, arrival_gaps, make_requests, summarize
from deploy.cli import main as cli_main


# -- definitions on a synthetic stream -----------------------------------------------------------------------
def test_request_result_definitions_on_known_timestamps():
    r = RequestResult(success=True, start=10.0, chunk_times=[10.4, 10.5, 10.7, 11.0], end=11.25, output_tokens=4)
    assert r.ttft == pytest.approx(0.4)
    assert r.itl == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((11.25 - 10.4) / 3)
    assert r.e2e == pytest.approx(1.25)
    # usage may report more tokens than chunks (several tokens in one chunk): TPOT divides by tokens
    r5 = RequestResult(success=True, start=0.0, chunk_times=[1.0, 2.0], end=2.0, output_tokens=5)
    assert r5.tpot == pytest.approx(1.0 / 4) and r5.itl == [1.0]
    assert RequestResult(success=True, start=0.0, chunk_times=[1.0], end=1.0, output_tokens=1).tpot is None


def test_summarize_percentiles_throughput_and_goodput():
    # TTFTs 0.1..1.0 s; 10 tokens each 0.05 s apart after the first
    results = []
    for i in range(10):
        start = float(i)
        first = start + 0.1 * (i + 1)
        chunks = [first + 0.05 * k for k in range(10)]
        results.append(RequestResult(success=True, start=start, chunk_times=chunks, end=chunks[-1],
                                     output_tokens=10, prompt_tokens=20))
    results.append(RequestResult(success=False, error="HTTP 500", start=0.0, end=0.1))
    s = summarize(results, 4.0, percentiles=[50, 90, 99], slos_ms={"ttft": 550.0})
    assert s["completed"] == 10 and s["failed"] == 1
    assert s["total_input_tokens"] == 200 and s["total_output_tokens"] == 100
    assert s["request_throughput"] == pytest.approx(2.5)
    assert s["output_throughput"] == pytest.approx(25.0)
    assert s["total_token_throughput"] == pytest.approx(75.0)
    assert s["mean_ttft_ms"] == pytest.approx(550.0)
    assert s["median_ttft_ms"] == pytest.approx(550.0)
    assert s["p90_ttft_ms"] == pytest.approx(910.0)  # linear interpolation between ranks 8 and 9
    assert s["p99_ttft_ms"] == pytest.approx(991.0)
    assert s["mean_tpot_ms"] == pytest.approx(50.0) and s["p99_itl_ms"] == pytest.approx(50.0)
    assert s["good_requests"] == 5 and s["goodput"] == pytest.approx(5 / 4.0)


def test_workload_lengths_ids_and_arrivals():
    fixed = make_requests(num_prompts=5, input_len=12, output_len=7, token_id_low=3, token_id_high=50, seed=1)
    assert all(len(r.prompt) == 12 and r.input_len == 12 and r.output_len == 7 for r in fixed)
    assert all(3 <= t < 50 for r in fixed for t in r.prompt)
    assert fixed == make_requests(num_prompts=5, input_len=12, output_len=7, token_id_low=3, token_id_high=50,
                                  seed=1)
    ranged = make_requests(num_prompts=200, input_len=100, output_len=10, range_ratio=0.5, seed=2)
    ins = [r.input_len for r in ranged]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 20
    assert all(len(r.prompt) == r.input_len for r in ranged)
    text = make_requests(num_prompts=3, input_len=9, output_len=4, prompt_type="text", seed=3)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 9 for r in text)
    gaps = arrival_gaps(4000, 50.0, seed=0)
    assert gaps[0] == 0.0 and sum(gaps) / (len(gaps) - 1) == pytest.approx(1 / 50.0, rel=0.06)
    assert arrival_gaps(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


# -- a loopback OpenAI-shaped streaming server ----------------------------------------------------------------
class _Peer:
    """Streams `max_tokens` tokens (first after `first_delay`, then every `token_delay`); with `eos_after`,
    stops early unless the request pins the length (ignore_eos / min_tokens). Rejects prompts holding `bad_id`."""

    def __init__(self, *, first_delay=0.03, token_delay=0.01, eos_after=None, bad_id=None):
        self.first_delay, self.token_delay, self.eos_after, self.bad_id = first_delay, token_delay, eos_after, bad_id
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.lock = threading.Lock()
        peer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send_json(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._send_json(200, {"object": "list", "data": [{"id": "peer-model", "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with peer.lock:
                    peer.bodies.append(body)
                    peer.in_flight += 1
                    peer.max_in_flight = max(peer.max_in_flight, peer.in_flight)
                try:
                    peer.serve(self, body)
                finally:
                    with peer.lock:
                        peer.in_flight -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def serve(self, h, body):
        prompt = body.get("prompt")
        if self.bad_id is not None and isinstance(prompt, list) and self.bad_id in prompt:
            h._send_json(400, {"error": {"message": "token id out of vocab", "type": "invalid_request_error"}})
            return
        chat = "messages" in body
        n_prompt = len(prompt) if isinstance(prompt, list) else len(
            (body["messages"][0]["content"] if chat else prompt).split())
        n_out = body["max_tokens"]
        if self.eos_after is not None and not body.get("ignore_eos") and body.get("min_tokens", 0) < n_out:
            n_out = min(n_out, self.eos_after)
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def event(obj):
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()

        time.sleep(self.first_delay)
        for i in range(n_out):
            if i:
                time.sleep(self.token_delay)
            choice = {"index": 0, "delta": {"content": f"t{i} "}} if chat else {"index": 0, "text": f"t{i} "}
            choice["finish_reason"] = None if i < n_out - 1 else "length"
            event({"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                   "choices": [choice]})
        event({"id": "x", "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                   "total_tokens": n_prompt + n_out}})
        event(b"[DONE]")
        h.wfile.write(b"0\r\n\r\n")
        h.wfile.flush()

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _bench(tmp_path, peer, *extra) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    rc = cli_main(["bench", "--base-url", peer.url, "--disable-tqdm", "--result-file", str(out),
                   "--save-detailed", *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else {})


def test_bench_streams_token_prompts_at_fixed_concurrency(tmp_path, capsys):
    with _Peer(first_delay=0.03, token_delay=0.01, eos_after=2) as peer:
        rc, res = _bench(tmp_path, peer, "--num-prompts", "8", "--input-len", "16", "--output-len", "6",
                         "--max-concurrency", "3", "--ignore-eos", "--token-id-range", "3", "40",
                         "--goodput", "ttft:60000")
    assert rc == 0
    assert res["completed"] == 8 and res["failed"] == 0 and res["model"] == "peer-model"
    assert res["total_input_tokens"] == 8 * 16 and res["total_output_tokens"] == 8 * 6  # ignore_eos pinned 6
    assert peer.max_in_flight == 3
    sent = peer.bodies
    assert len(sent) == 8 and all(b["stream"] and b["ignore_eos"] and b["min_tokens"] == 6 for b in sent)
    assert all(isinstance(b["prompt"], list) and len(b["prompt"]) == 16 for b in sent)
    assert all(b["stream_options"] == {"include_usage": True} for b in sent)
    for r in res["requests"]:
        assert r["ttft_s"] >= 0.03  # the peer waits 30 ms before the first token
        # the peer spends >= 30 + 5 * 10 ms on a request; chunks read together (a busy client) share one time
        assert r["e2e_s"] >= 0.08
        assert len(r["itl_s"]) == 5 and min(r["itl_s"]) >= 0.0
        assert r["ttft_s"] + sum(r["itl_s"]) <= r["e2e_s"] + 1e-9
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 5)
    assert res["good_requests"] == 8 and res["p99_ttft_ms"] >= res["median_ttft_ms"] >= 30.0
    table = capsys.readouterr().out
    assert "Serving Benchmark Result" in table and "P99 TTFT (ms)" in table and "Request goodput" in table


def test_bench_without_ignore_eos_reports_what_the_server_generated(tmp_path):
    with _Peer(first_delay=0.0, token_delay=0.0, eos_after=2) as peer:
        rc, res = _bench(tmp_path, peer, "--num-prompts", "4", "--input-len", "5", "--output-len", "6")
    assert rc == 0 and res["total_output_tokens"] == 4 * 2
    assert all("ignore_eos" not in b for b in peer.bodies)


def test_bench_poisson_rate_spaces_the_requests(tmp_path):
    n, rate = 6, 20.0
    with _Peer(first_delay=0.0, token_delay=0.0) as peer:
        rc, res = _bench(tmp_path, peer, "--num-prompts", str(n), "--input-len", "4", "--output-len", "2",
                         "--request-rate", str(rate), "--seed", "5")
    assert rc == 0 and res["completed"] == n
    assert res["duration_s"] >= sum(arrival_gaps(n, rate, seed=5))
    assert res["request_rate"] == rate


def test_bench_text_prompts_through_chat_completions(tmp_path):
    with _Peer(first_delay=0.0, token_delay=0.0) as peer:
        rc, res = _bench(tmp_path, peer, "--num-prompts", "3", "--input-len", "7", "--output-len", "3",
                         "--prompt-type", "text", "--endpoint", "/v1/chat/completions", "--model", "m")
    assert rc == 0 and res["completed"] == 3 and res["total_output_tokens"] == 9
    assert all(b["model"] == "m" and len(b["messages"][0]["content"].split()) == 7 for b in peer.bodies)


def test_bench_counts_failed_requests(tmp_path, capsys):
    # ids 3..6 drawn for 12 prompts of 3 tokens: some contain the rejected id 3, some do not
    with _Peer(first_delay=0.0, token_delay=0.0, bad_id=3) as peer:
        rc, res = _bench(tmp_path, peer, "--num-prompts", "12", "--input-len", "3", "--output-len", "2",
                         "--token-id-range", "3", "7", "--seed", "0")
    reqs = make_requests(num_prompts=12, input_len=3, output_len=2, token_id_low=3, token_id_high=7, seed=0)
    bad = sum(3 in r.prompt for r in reqs)
    assert 0 < bad < 12
    assert res["failed"] == bad and res["completed"] == 12 - bad and rc == 0
    assert any("HTTP 400" in e for e in res["errors"])
    assert "HTTP 400" in capsys.readouterr().err


def test_bench_rejects_bad_arguments(capsys):
    assert cli_main(["bench", "--num-prompts", "0"]) == 2
    assert cli_main(["bench", "--prompt-type", "tokens", "--endpoint", "/v1/chat/completions"]) == 2
    assert cli_main(["bench", "--goodput", "latency:5"]) == 2
    assert "bench:" in capsys.readouterr().err


def test_bench_bad_port_fails_cleanly(tmp_path):
    # nothing listens on this loopback port: every request fails, the run still ends and reports
    rc = cli_main(["bench", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
                   "--input-len", "2", "--output-len", "2", "--disable-tqdm", "--request-timeout", "5",
                   "--result-file", str(tmp_path / "r.json")])
    res = json.loads((tmp_path / "r.json").read_text())
    assert rc == 1 and res["failed"] == 2 and res["completed"] == 0

