"""CUDA-graph timing shared by the kernel benchmarks (PERF.md's method: replay after warm-up, CUDA events,
median)."""
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
