"""An engine's outputs: `EngineCoreOutput`s (a step's new token ids per sample) -> cumulative `RequestOutput`s.

`OutputProcessor` keeps what a request gained so far beyond the core's token lists (logprobs, prompt logprobs)
and builds the `RequestOutput` the engine API returns: token ids, logprobs, finish reasons; no text. Text
(detokenizing, stop strings) is made where it is shown, from these token ids: in the ingress (deploy/output.py)
and in the offline `LLM` (workers/text.py); a stop string found there comes back as `EngineAPI.stop_sample`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workers.core import EngineCoreOutput
from workers.request import CompletionOutput, RequestOutput
from workers.scheduler import Request


@dataclass(eq=False)
class _Progress:
    """One request's logprobs and prompt logprobs so far, per sample."""

    req: Request
    prompt: str | None
    logprobs: list[list[dict[int, float]] | None]
    prompt_logprobs: list[dict[int, float] | None] | None = None


class OutputProcessor:
    def __init__(self) -> None:
        self._progress: dict[str, _Progress] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        """Start the outputs of a request the core just took (its Request is read, never changed, here)."""
        want = req.params.logprobs is not None
        self._progress[req.request_id] = _Progress(
            req=req, prompt=prompt, logprobs=[[] if want else None for _ in range(req.params.n)])

    def drop(self, request_id: str) -> None:
        self._progress.pop(request_id, None)

    def process(self, outputs: Iterable[EngineCoreOutput]) -> list[RequestOutput]:
        """Take a step's tokens; one cumulative RequestOutput per request touched, in first-touched order.
        Finished requests are forgotten here."""
        touched: dict[str, _Progress] = {}
        for out in outputs:
            p = self._progress[out.request_id]
            touched[out.request_id] = p
            if out.prompt_logprobs is not None:
                p.prompt_logprobs = out.prompt_logprobs
            lps = p.logprobs[out.index]
            if lps is not None and out.new_logprobs is not None:
                lps.extend(out.new_logprobs)
        results = [self.output(rid) for rid in touched]
        for r in results:
            if r.finished:
                del self._progress[r.request_id]
        return results

    def output(self, request_id: str) -> RequestOutput:
        """The request's cumulative output now."""
        p = self._progress[request_id]
        req = p.req
        outs = []
        for seq in req.seqs:
            lps = p.logprobs[seq.index]
            handoff = seq.finish_reason == "handoff"  # the request goes on elsewhere: as unfinished here
            outs.append(CompletionOutput(index=seq.index, token_ids=seq.output_token_ids,
                                         logprobs=list(lps) if lps is not None else None,
                                         finish_reason=None if handoff else seq.finish_reason,
                                         stop_reason=seq.stop_reason))
        return RequestOutput(request_id=req.request_id, prompt=p.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=req.finished,
                             prompt_logprobs=list(p.prompt_logprobs) if p.prompt_logprobs is not None else None)
