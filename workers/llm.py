"""The offline API, shaped like vLLM's: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from workers.config import EngineConfig, ParallelConfig
from workers.engine import make_engine
from workers.request import RequestOutput, SamplingParams

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
        for (text, ids), p in zip(tokenized, param_list):
            rid = f"llm-{next(self._ids)}"
            try:
                self.engine.add_request(rid, ids, p, prompt=text)
            except ValueError:
                for done in order:  # leave the engine as we found it
                    self.engine.abort_request(done)
                raise
            order.append(rid)
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[rid] for rid in order]

    def _tokens(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.engine.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        raise ValueError("prompts: each prompt is a string or {'prompt_token_ids': [...]}")
