"""Timing shared by the kernel benchmarks: CUDA-graph replay (PERF.md's decode method: replay after warm-up,
CUDA events, median) and eager calls timed one by one with CUDA events (the prefill method)."""
from __future__ import annotations

import statistics

import torch


def graph_replay_ms(fn, replays: int = 20) -> float:
    """Median ms of one replay of a graph holding one call of `fn` (two eager calls first: compiles, lazy init)."""
    fn()
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times)


def eager_event_ms(fn, reps: int = 20, warmup: int = 1) -> float:
    """Median ms of one eager call of `fn`, CUDA events around each call, after `warmup` calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
