"""Where converted weights and compiled kernels are cached: `~/.cache/metronome`, or
`METRONOME_CACHE`. (Its own module: the kernels' builder needs it and must not import the
weight loader, which imports the model.)"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("METRONOME_CACHE") or Path.home() / ".cache" / "metronome"
    return Path(root)
