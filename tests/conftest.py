"""Shared test harness: markers, the Ray environment guards, and helpers for kernel tests."""
from __future__ import annotations

import os

# Ray guards (DEVELOPERS.md / RAY_NOTES.md): loopback only, no usage reports, no token auth for test clusters.
# Set before anything imports ray so every test, fixture and spawned worker inherits them.
_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_USAGE_STATS_REPORT_URL": "http://127.0.0.1:9/",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_DEDUP_LOGS": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
for _k, _v in _RAY_ENV.items():
    os.environ[_k] = _v

import pytest  # noqa: E402
import torch  # noqa: E402

# Triton reads TRITON_INTERPRET once, when it is first imported (any test folder may import it first through
# workers -> msa -> kernels). Without a GPU, run Triton kernels in the interpreter; launchers still default to
# the torch references on CPU tensors, so only tests that ask for backend="triton" see a difference.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# The test models are tiny: intra-op threads cost far more than they give on a 2-core machine where Ray
# workers share the cores (decode loops measured ~30x slower with the default thread count).
if not torch.cuda.is_available():
    torch.set_num_threads(1)


def _cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA devices")
    # opt-in: the chaos run kills replicas for minutes; only a marker expression naming it selects it
    skip_chaos = pytest.mark.skip(reason="opt-in: run with -m chaos")
    chaos_selected = "chaos" in (config.option.markexpr or "")
    for item in items:
        if "chaos" in item.keywords and not chaos_selected:
            item.add_marker(skip_chaos)
        if "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN so a kernel that forgets to write an element fails its comparison."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    return t.fill_(-(2**30) if t.dtype in (torch.int32, torch.int64) else 0x7F)


def assert_all_written(t: torch.Tensor, name: str = "output") -> None:
    """Fail if any element of a poisoned float buffer is still NaN."""
    bad = torch.isnan(t).sum().item() if t.dtype.is_floating_point else 0
    assert bad == 0, f"{name}: {bad} of {t.numel()} elements were never written"


@pytest.fixture
def nan_poison():
    """The NaN-poison helpers for kernel tests: `poison_(buf)` before a launch, `assert_all_written(buf)` after."""
    return poison_, assert_all_written
