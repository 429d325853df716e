"""Where and at what priority an engine's step thread runs: `StepPlacement`, read from the environment.

The step thread does a decode step's host work (schedule, inputs, launch, outputs) between GPU steps; a step it
loses the CPU in is a step every request waits for. Two knobs, both per thread (Linux keeps affinity and niceness
per thread, so the engine replica's other threads are untouched):

- `M3SERVE_STEP_CPUS` ("15", "14-15,30"; unset: the OS places it): the CPUs it pins itself to, so its work never
  shares a core with the ingress, the proxy or a client on the same host.
- `M3SERVE_STEP_NICE` (-20..19; unset or "inherit": leave it): its scheduling niceness, and that of each thread
  whose event loop receives its outputs (`apply_to_caller`, once per thread: in a Serve replica the replica's
  loop, which publishes the tokens; threads that loop starts afterwards inherit it). Ray runs each worker
  process's main thread, and the threads it starts, at niceness 15 (its `worker_niceness`: the control plane
  first), the step thread among them; at 15 it gets about 3% of a CPU while a niceness-0 task runs there
  (scheduler weights 36 against 1024), and the load balancer counts it as almost no load. 0 puts it level with the
  in-process engine. Both threads move together: with the step thread alone at 0, on 2 loaded cores it starved
  the loop (still at 15), which then published tokens in bursts (docs/benchmarks.md S8). Opt-in: on the H200 (S10)
  Serve was within +1.9% of the in-process engine with it and without it alike. Lowering a thread's niceness
  needs CAP_SYS_NICE (root outside most containers); without it the thread keeps its niceness and says so once.

The thread also takes the OS name `STEP_THREAD_NAME` (Linux `prctl`), so `top -H`, py-spy and the tests find it.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger("m3serve.engine")

STEP_THREAD_NAME = "engine-step"  # the OS's 15-character thread name
STEP_CPUS_ENV = "M3SERVE_STEP_CPUS"
STEP_NICE_ENV = "M3SERVE_STEP_NICE"
DEFAULT_NICE = None  # inherit


@dataclass(frozen=True)
class StepPlacement:
    cpus: frozenset[int] | None = None  # None: where the OS puts it
    nice: int | None = DEFAULT_NICE  # None: the niceness it was started with

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> StepPlacement:
        """Both knobs, checked (a bad value raises ValueError naming its variable: call before loading a model)."""
        return cls(cpus=step_cpus(env.get(STEP_CPUS_ENV)), nice=step_niceness(env.get(STEP_NICE_ENV)))

    def apply(self) -> None:
        """On the step thread, first thing: name it, pin it and set its niceness (this thread only)."""
        _name_this_thread(STEP_THREAD_NAME)
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)
        _set_this_threads_niceness(self.nice, "engine step thread")

    def apply_to_caller(self, done: set[int]) -> None:
        """On a thread that submits requests (its event loop gets the outputs): its niceness, once per thread
        (`done`: the native ids of the threads already set; a set lookup after the first call). Not pinned."""
        tid = threading.get_native_id()
        if tid not in done:
            done.add(tid)
            _set_this_threads_niceness(self.nice, "engine caller's event-loop thread")


def _set_this_threads_niceness(nice: int | None, what: str) -> None:
    if nice is None or not sys.platform.startswith("linux"):  # elsewhere a thread id is no pid
        return
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    if before == nice:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread id names that thread only
    except OSError as e:
        logger.warning("%s stays at niceness %d, not %d (%s): it runs behind any busier process on its CPU; "
                       "give the process CAP_SYS_NICE, or start Ray with RAY_worker_niceness=0 "
                       "(docs/operations.md)", what, before, nice, e)


def _name_this_thread(name: str) -> None:
    """The calling thread's OS name (Linux only; Python names threads for itself alone before 3.14)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME: the calling thread
    except (OSError, AttributeError):
        pass


def parse_cpus(spec: str) -> set[int]:
    """"14-15,30" -> {14, 15, 30} (the cpuset list format); ValueError names a malformed part."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            raise ValueError(f"{STEP_CPUS_ENV}: {part!r} is not a CPU id or range") from None
        if first < 0 or last < first:
            raise ValueError(f"{STEP_CPUS_ENV}: {part!r} is not a CPU id or range")
        cpus.update(range(first, last + 1))
    return cpus


def step_cpus(spec: str | None) -> frozenset[int] | None:
    """The CPUs of `spec` for the step thread (None: unset), checked against this host's CPUs."""
    if not spec:
        return None
    cpus = parse_cpus(spec)
    have = os.cpu_count() or 1
    if not cpus or max(cpus) >= have:
        raise ValueError(f"{STEP_CPUS_ENV}={spec!r}: this host has CPUs 0-{have - 1}")
    return frozenset(cpus)


def step_niceness(spec: str | None) -> int | None:
    """The step thread's niceness from `spec`: unset, empty or "inherit" -> DEFAULT_NICE (None: leave it)."""
    if spec is None or not spec.strip() or spec.strip() == "inherit":
        return DEFAULT_NICE
    try:
        nice = int(spec)
    except ValueError:
        raise ValueError(f"{STEP_NICE_ENV}={spec!r}: an integer from -20 to 19, or 'inherit'") from None
    if not -20 <= nice <= 19:
        raise ValueError(f"{STEP_NICE_ENV}={spec!r}: an integer from -20 to 19, or 'inherit'")
    return nice
