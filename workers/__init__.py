"""The engine layer: scheduler, page manager, sampler, shard actors and the offline `LLM` API."""
from workers.request import CompletionOutput, RequestOutput, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # LLM pulls in torch and the model; import it only when asked for, so `workers.config` etc. stay light.
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    raise AttributeError(f"module 'workers' has no attribute {name!r}")
