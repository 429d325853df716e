"""What an engine needs of an executor, and the error that stops an engine."""
from __future__ import annotations

from typing import Protocol

from workers.batch import StepBatch
from workers.runner import StepResult


class ExecutorDeadError(RuntimeError):
    """The executor can run no more steps (a worker group lost a rank, a shard actor died): the engine stops,
    where any other error of a step fails only that step's requests."""


class GroupError(ExecutorDeadError):
    """A running worker group lost a rank (its step failed or its actor died); the group is unusable (its peers
    may be stuck in a collective with it), so the engine stops rather than failing only that step's requests."""


def cause_of(e: BaseException) -> str:
    """The original error of a failed actor call, as `Type: message` (the first line of a Ray task error)."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class Executor(Protocol):
    """Runs steps on the instance's shard(s)."""

    def info(self) -> dict: ...

    def execute(self, batch: StepBatch) -> StepResult: ...

    # optional: `launch(batch) -> handle` (`handle.result() -> StepResult`) starts a step without waiting; an
    # executor that has it can run async scheduling (workers/engine_api.py `_step_async`)

    def shutdown(self) -> None: ...
