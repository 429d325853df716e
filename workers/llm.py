"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`.

The engine returns token ids; the text (and the stop strings found in it) is made here, one `RequestText` per
request (workers/text.py, the same code the ingress runs), and a stop string stops its sample in the engine
(`stop_sample`) before the next step."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from workers.config import EngineConfig, ParallelConfig
from workers.engine import make_engine
from workers.request import CompletionOutput, RequestOutput, SamplingParams
from workers.text import RequestText

Prompt = str | dict


class LLM:
    """One engine in this process. `model`: a checkpoint directory (None = the built-in tiny model).
    Extra keyword arguments are `EngineConfig` fields (e.g. `num_pages=64`, `max_num_batched_tokens=256`)."""

    def __init__(self, model: str | Path | None = None, device: str = "cpu", tp: int = 1, ep: int = 1, dp: int = 1,
                 **engine_config_fields) -> None:
        if model is None:
            from workers.models import tiny_model_dir

            model = tiny_model_dir()
        executor = engine_config_fields.pop("executor", "auto")
        self.engine = make_engine(model, engine_config=EngineConfig(**engine_config_fields),
                             parallel=ParallelConfig(tp=tp, ep=ep, dp=dp), device=device, executor=executor)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        """Run every prompt to completion, all in flight together; one `RequestOutput` per prompt, in order.

        A prompt is a string (tokenized without added special tokens, as the chat template writes its own) or
        `{"prompt_token_ids": [...]}` (optionally with "prompt": text)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None:
            params = SamplingParams()
        param_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(param_list) != len(prompts):
            raise ValueError(f"params: {len(param_list)} sampling params for {len(prompts)} prompts")
        tokenized = [self._tokens(prompt) for prompt in prompts]
        order: list[str] = []
        texts: dict[str, _Text] = {}
        for (text, ids), p in zip(tokenized, param_list):
            rid = f"llm-{next(self._ids)}"
            try:
                self.engine.add_request(rid, ids, p, prompt=text)
            except ValueError:
                for done in order:  # leave the engine as we found it
                    self.engine.abort_request(done)
                raise
            order.append(rid)
            texts[rid] = _Text(RequestText(self.engine.tokenizer, ids, p), p.n)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            outputs = self.engine.step()
            while outputs:
                stopped = []
                for out in outputs:
                    t = texts[out.request_id]
                    stopped += [(out.request_id, i, stop) for i, stop in t.take(out)]
                    if t.text.finished:
                        final[out.request_id] = t.output(out)
                outputs = [o for rid, i, stop in stopped for o in self.engine.stop_sample(rid, i, stop)]
        return [final[rid] for rid in order]

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise ValueError("prompts: each prompt is a string or {'prompt_token_ids': [...]}")


class _Text:
    """One request's text as its cumulative outputs arrive: the new tokens of each sample go to its
    `RequestText`; the samples kept for the final output (tokens up to a stop string, text, finish)."""

    def __init__(self, text: RequestText, n: int) -> None:
        self.text = text
        self._seen = [0] * n  # tokens of each sample taken from the engine's outputs
        self._ids: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[dict[int, float]]] = [[] for _ in range(n)]
        self._texts = [""] * n

    def take(self, out: RequestOutput) -> list[tuple[int, str]]:
        """Feed `out`'s new tokens; the (sample, stop string) pairs a stop string ended now."""
        hits = []
        for comp in out.outputs:
            i, seen = comp.index, self._seen[comp.index]
            new = comp.token_ids[seen:]
            self._seen[i] = len(comp.token_ids)
            lps = None if comp.logprobs is None else comp.logprobs[seen:]
            delta = self.text.add(i, new, lps, comp.finish_reason, comp.stop_reason)
            self._ids[i] += delta.token_ids
            self._logprobs[i] += delta.logprobs or []
            self._texts[i] += delta.text
            if delta.stop_hit:
                hits.append((i, delta.stop_reason))
        return hits

    def output(self, out: RequestOutput) -> RequestOutput:
        """The final output: the engine's, with each sample's kept tokens, text and finish."""
        comps = [CompletionOutput(index=s.index, token_ids=self._ids[s.index], text=self._texts[s.index],
                                  logprobs=self._logprobs[s.index] if s.logprobs is not None else None,
                                  finish_reason=self.text.samples[s.index].finish_reason,
                                  stop_reason=self.text.samples[s.index].stop_reason) for s in out.outputs]
        return RequestOutput(request_id=out.request_id, prompt=out.prompt, prompt_token_ids=out.prompt_token_ids,
                             outputs=comps, finished=True, prompt_logprobs=out.prompt_logprobs)
