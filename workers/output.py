"""The text side of an engine's outputs: `EngineCoreOutput`s (token ids) -> `RequestOutput`s (ids and text).

`OutputProcessor` detokenizes each sample incrementally, finds stop strings in the new text (a hit is handed back
to the request's core with `EngineCore.stop_sequence`, which finishes the sample there) and builds the cumulative
`RequestOutput` the engine API returns. It holds text only; token state stays in the core. DESIGN.md puts this
in the ingress (issue 19 moves it there); until then `Engine` and `DPEngine` each own one.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workers.core import EngineCore, EngineCoreOutput
from workers.request import CompletionOutput, RequestOutput
from workers.scheduler import Request
from workers.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop_string, stop_holdback


@dataclass(eq=False)
class _Text:
    """One request's text, logprobs and prompt logprobs so far, per sample."""

    req: Request
    prompt: str | None
    detoks: list[IncrementalDetokenizer]
    texts: list[str]
    logprobs: list[list[dict[int, float]] | None]
    stopped_by_string: list[bool]
    holdback: int
    prompt_logprobs: list[dict[int, float] | None] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[str, _Text] = {}

    def add(self, req: Request, prompt: str | None) -> None:
        """Start the text of a request the core just took (its Request is read, never changed, here)."""
        params = req.params
        n = params.n
        self._texts[req.request_id] = _Text(
            req=req, prompt=prompt,
            detoks=[IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
                    for _ in range(n)],
            texts=[""] * n,
            logprobs=[[] if params.logprobs is not None else None for _ in range(n)],
            stopped_by_string=[False] * n,
            holdback=stop_holdback(params.stop))

    def drop(self, request_id: str) -> None:
        self._texts.pop(request_id, None)

    def process(self, core: EngineCore, outputs: Iterable[EngineCoreOutput]) -> list[RequestOutput]:
        """Append a step's tokens to the text of their requests (a stop-string hit finishes the sample in
        `core`); one cumulative RequestOutput per request touched, in first-touched order. Finished requests
        are forgotten here."""
        touched: dict[str, _Text] = {}
        for out in outputs:
            t = self._texts[out.request_id]
            touched[out.request_id] = t
            self._on_token(core, t, out)
        results = [self.output(rid) for rid in touched]
        for r in results:
            if r.finished:
                del self._texts[r.request_id]
        return results

    def first_logprobs(self, request_id: str) -> dict[int, float] | None:
        """The logprobs of sample 0's first token (None when the request asked for none)."""
        lps = self._texts[request_id].logprobs[0]
        return lps[0] if lps else None

    def _on_token(self, core: EngineCore, t: _Text, out: EngineCoreOutput) -> None:
        i = out.index
        seq = t.req.seqs[i]
        if out.prompt_logprobs is not None:
            t.prompt_logprobs = out.prompt_logprobs
        if t.logprobs[i] is not None and out.new_logprobs is not None:
            t.logprobs[i].extend(out.new_logprobs)
        delta = t.detoks[i].add(out.new_token_ids)
        params = t.req.params
        if delta:
            start = len(t.texts[i])
            t.texts[i] += delta
            if params.stop and seq.finish_reason != "stop":  # an EOS / stop id already ended it
                hit = find_stop_string(t.texts[i], params.stop, start)
                if hit is not None:
                    idx, stop = hit
                    t.texts[i] = t.texts[i][:idx + len(stop) if params.include_stop_str_in_output else idx]
                    t.stopped_by_string[i] = True
                    core.stop_sequence(t.req.request_id, i, stop)
        if seq.finished and not t.stopped_by_string[i] and seq.finish_reason != "handoff":
            t.texts[i] += t.detoks[i].flush()

    def output(self, request_id: str) -> RequestOutput:
        """The request's cumulative output now."""
        t = self._texts[request_id]
        req = t.req
        outs = []
        for seq in req.seqs:
            i = seq.index
            text = t.texts[i]
            handoff = seq.finish_reason == "handoff"  # the request goes on elsewhere: as unfinished here
            if t.holdback and (seq.finish_reason is None or handoff):
                # Never show the start of a stop string a later token may complete (the text would shrink).
                text = text[:max(len(text) - t.holdback, 0)]
            outs.append(CompletionOutput(index=i, token_ids=seq.output_token_ids, text=text,
                                         logprobs=list(t.logprobs[i]) if t.logprobs[i] is not None else None,
                                         finish_reason=None if handoff else seq.finish_reason,
                                         stop_reason=seq.stop_reason))
        return RequestOutput(request_id=req.request_id, prompt=t.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=outs, finished=req.finished,
                             prompt_logprobs=list(t.prompt_logprobs) if t.prompt_logprobs is not None else None)
