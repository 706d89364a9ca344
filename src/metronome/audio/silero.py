"""The Silero VAD network: 16 kHz audio in 512-sample chunks -> the probability of speech.

The model is the ONNX file shipped in the PyPI wheel `silero-vad` (`silero_vad/data/
silero_vad.onnx`), run by ONNX Runtime on one intra-op and one inter-op thread. The
`silero_vad` package itself is never imported: its import calls `torch.set_num_threads(1)`,
which would throttle the engine's torch threads for the whole process. Only the file's
location is looked up (`importlib.util.find_spec` reads no module), and nothing here
touches torch.

Owns the shared network (`SileroVad`: one ONNX Runtime session for every stream) and one
stream's recurrent state (`SileroState`: the LSTM state and the last 64 samples, which the
network sees before each chunk, as the package's own wrapper feeds it). A `SileroVad` is
run from one thread at a time (the server's VAD thread).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SILERO_RATE_HZ = 16000
CHUNK_SAMPLES = 512  # what the 16 kHz network takes per call: 32 ms
CONTEXT_SAMPLES = 64  # samples of the previous chunk prepended to each chunk
_STATE_SHAPE = (2, 1, 128)  # (h/c, batch, hidden) of the network's LSTM
MODEL_FILE = "silero_vad.onnx"


def model_path() -> Path:
    """The ONNX file inside the installed `silero-vad` wheel, found without importing it."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the silero-vad package is not installed (make install)")
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"silero-vad is installed but has no {path}")
    return path


@dataclass
class SileroState:
    """One stream's carry-over between chunks."""

    lstm: np.ndarray = field(default_factory=lambda: np.zeros(_STATE_SHAPE, np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT_SAMPLES, np.float32))


class SileroVad:
    def __init__(self, path: Path | None = None) -> None:
        import onnxruntime  # imported here: only servers that detect turns load it

        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = 1
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        self._session = onnxruntime.InferenceSession(
            str(path or model_path()), sess_options=options,
            providers=["CPUExecutionProvider"])
        self._rate = np.array(SILERO_RATE_HZ, dtype=np.int64)

    def speech_probability(self, state: SileroState, chunk: np.ndarray) -> float:
        """P(speech) for one chunk of `CHUNK_SAMPLES` float32 samples; advances `state`."""
        assert chunk.shape == (CHUNK_SAMPLES,), chunk.shape
        frame = np.concatenate([state.context, chunk]).astype(np.float32, copy=False)[None, :]
        probability, state.lstm = self._session.run(
            None, {"input": frame, "state": state.lstm, "sr": self._rate})
        state.context = frame[0, -CONTEXT_SAMPLES:]
        return float(probability[0, 0])
