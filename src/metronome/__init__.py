"""Metronome: real-time interaction model serving with bounded per-session KV.

The public API, importable from the package itself (loaded on first use, so that
`import metronome` stays cheap):

    from metronome import Engine, EngineConfig, SessionSpec, ResidencyPolicy, load_model

The record: `Stream` (one session, carried from the socket to the engine), `Frame`,
`FrameStatus`. Engine: `Engine`, `EngineConfig`, `SessionSpec`, `SamplingParams`,
`SessionError`, `ResidencyPolicy`, `load_model`, `load_tokenizer`. Runtime:
`SessionProfile`, `SessionMode`, `Listeners`, `WallDriver`, `VirtualDriver`, `StepCostModel`,
`EnginePort` (the seam an engine implements). Server: `ServerConfig`, `create_app`.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "metronome.engine.engine",
    "EngineConfig": "metronome.engine.engine",
    "SessionError": "metronome.engine.engine",
    "SessionSpec": "metronome.engine.session",
    "SamplingParams": "metronome.engine.sampling",
    "ResidencyPolicy": "metronome.kv.residency",
    "load_model": "metronome.model.weights",
    "load_tokenizer": "metronome.model.weights",
    "SessionProfile": "metronome.runtime.profile",
    "SessionMode": "metronome.runtime.profile",
    "Stream": "metronome.stream",
    "Frame": "metronome.stream",
    "FrameStatus": "metronome.stream",
    "Listeners": "metronome.runtime.ports",
    "EnginePort": "metronome.runtime.ports",
    "WallDriver": "metronome.runtime.wall",
    "VirtualDriver": "metronome.sim.virtual",
    "StepCostModel": "metronome.sim.cost_model",
    "ServerConfig": "metronome.serve.config",
    "create_app": "metronome.serve.app",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'metronome' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
