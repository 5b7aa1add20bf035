"""Where gspo-trl keeps what it builds once per machine and user: the demo's dequantized model, compiled kernels.

It owns the folder's location only; what goes in it belongs to its writers."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Directory holding gspo-trl's cached artefacts (explicit argument > env vars > ~/.cache)."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("GSPO_TRL_CACHE"):
        return Path(os.environ["GSPO_TRL_CACHE"]).expanduser()
    xdg_cache = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg_cache).expanduser() if xdg_cache else Path.home() / ".cache"
    return base / "gspo-trl"
