"""Model directories the engine can serve: random preset checkpoints and the cached built-in tiny model.

The presets live in `configs/models/<name>.yaml` (fields of `msa.config.M3Config`); the weights are written by
`msa.checkpoint.write_checkpoint`. `tiny_model_dir()` writes the tiny model once per (preset, seed, writer code)
into a cache directory and reuses it afterwards, so tests and `make serve` share one copy.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import msa.chat_template
import msa.checkpoint
from msa.checkpoint import HUB, write_checkpoint
from msa.config import M3Config
from workers.configio import load_yaml, preset_path

TINY_PRESET = "tiny"
TINY_SEED = 0
CACHE_ENV = "M3SERVE_CACHE"
# Files every complete checkpoint directory holds; a cached dir missing one is rewritten.
_REQUIRED = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json")


def preset_config(preset: str) -> M3Config:
    """The `M3Config` of `configs/models/<preset>.yaml`, strictly loaded."""
    return load_yaml(preset_path("models", preset), M3Config)


def write_preset_checkpoint(preset: str, out_dir: str | Path, seed: int = 0, layout: str = HUB, *,
                            num_shards: int = 2, device: str = "cpu") -> Path:
    """Write a random checkpoint of `preset` into `out_dir` (created); returns the directory."""
    return write_checkpoint(preset_config(preset), out_dir, seed=seed, layout=layout, num_shards=num_shards,
                            device=device)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else `$M3SERVE_CACHE`, else `~/.cache/m3serve`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "m3serve"


def _cache_key(preset: str, seed: int, layout: str) -> str:
    """Changes whenever the preset file, the seed, the layout or the writer's code changes."""
    h = hashlib.sha256()
    h.update(preset_path("models", preset).read_bytes())
    h.update(f"seed={seed};layout={layout}".encode())
    h.update(Path(msa.checkpoint.__file__).read_bytes())
    h.update(Path(msa.chat_template.__file__).read_bytes())  # the checkpoint writes this template
    return h.hexdigest()[:16]


def cached_preset_dir(preset: str, *, seed: int = 0, layout: str = HUB, cache_dir: str | Path | None = None) -> Path:
    """Write `preset` once into the cache and return its directory. Concurrent callers are safe: each writes a
    private temp dir and renames it into place; the loser of the race discards its copy."""
    root = cache_root(cache_dir)
    final = root / f"{preset}-{_cache_key(preset, seed, layout)}"
    if all((final / f).is_file() for f in _REQUIRED):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{preset}-", dir=root))
    try:
        write_preset_checkpoint(preset, tmp, seed=seed, layout=layout)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared by the user's processes
        if final.exists():  # an incomplete entry (interrupted copy, deleted file): replace it
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            # Someone else finished first (the target exists and is non-empty); theirs is identical.
            if not all((final / f).is_file() for f in _REQUIRED):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def tiny_model_dir(cache_dir: str | Path | None = None) -> Path:
    """The built-in tiny model (hub layout, seed 0), written on first use."""
    return cached_preset_dir(TINY_PRESET, seed=TINY_SEED, layout=HUB, cache_dir=cache_dir)


__all__ = ["write_preset_checkpoint", "tiny_model_dir", "cached_preset_dir", "preset_config", "cache_root",
           "TINY_PRESET", "CACHE_ENV"]
