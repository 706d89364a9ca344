"""Real speech for load: WAV fixtures synthesized with espeak-ng, looped into a stream.

Fixtures are stored small (16 kHz mono PCM16, shipped in the package: `SPEECH_DIR`) and
resampled to the session's rate when a stream is built. Resampling is band-limited
(FFT: zero-padding or truncating the spectrum), exact enough for a stand-in front end.

Regenerate (needs Debian's `espeak-ng`):
`python -m metronome.load.speech src/metronome/load/fixtures`
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import wave
from pathlib import Path

import numpy as np
import torch

from metronome.audio.pcm import decode_pcm16, encode_pcm16

SPEECH_DIR = Path(__file__).parent / "fixtures"  # package data: found from any directory
FIXTURE_RATE_HZ = 16000
SENTENCES = {
    "weather": "What will the weather be like tomorrow?",
    "booking": "Please book a table for two at seven.",
    "station": "How far is the train station from here?",
}
GAP_S = 0.3  # silence between looped utterances
SILENCE_LEVEL = 0.01  # trim leading and trailing audio below this (of full scale)
GATE_WINDOW_MS = 10.0  # the energy gate's window
GATE_BRIDGE_MS = 300.0  # quieter gaps shorter than this are inside one utterance


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    """Mono PCM16 WAV -> (float32 samples in [-1, 1), sample rate)."""
    with wave.open(str(path), "rb") as wav:
        if wav.getsampwidth() != 2 or wav.getnchannels() != 1:
            raise ValueError(f"{path}: need mono 16-bit PCM")
        data = wav.readframes(wav.getnframes())
        rate_hz = wav.getframerate()
    return decode_pcm16(data).numpy(), rate_hz


def write_wav(path: Path, samples: np.ndarray, rate_hz: int) -> None:
    with wave.open(str(path), "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(rate_hz)
        wav.writeframes(to_pcm16(samples))


def to_pcm16(samples: np.ndarray) -> bytes:
    return encode_pcm16(torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32)))


def resample(samples: np.ndarray, from_hz: int, to_hz: int) -> np.ndarray:
    if from_hz == to_hz:
        return samples
    num_out = round(len(samples) * to_hz / from_hz)
    spectrum = np.fft.rfft(samples)
    kept = np.zeros(num_out // 2 + 1, dtype=complex)
    keep = min(len(spectrum), len(kept))
    kept[:keep] = spectrum[:keep]
    return (np.fft.irfft(kept, num_out) * (num_out / len(samples))).astype(np.float32)


def synthesize(text: str, path: Path, rate_hz: int = FIXTURE_RATE_HZ) -> None:
    """espeak-ng (22.05 kHz) -> trimmed, resampled mono PCM16 WAV at `rate_hz`."""
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "raw.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "165", "-w", str(raw), text],
                       check=True)
        samples, source_hz = read_wav(raw)
    loud = np.flatnonzero(np.abs(samples) > SILENCE_LEVEL)
    samples = samples[loud[0]: loud[-1] + 1] if len(loud) else samples
    write_wav(path, resample(samples, source_hz, rate_hz), rate_hz)


def utterances(names: list[str], rate_hz: int, pauses_s: list[float],
               audio_dir: Path = SPEECH_DIR) -> np.ndarray:
    """Float samples at `rate_hz`: `pauses_s[0]` of silence, then each fixture in `names`
    followed by the next pause (one pause more than names): turns with known silences."""
    if len(pauses_s) != len(names) + 1:
        raise ValueError(f"{len(names)} utterances need {len(names) + 1} pauses, "
                         f"got {len(pauses_s)}")
    parts = [np.zeros(round(pauses_s[0] * rate_hz), dtype=np.float32)]
    for name, pause_s in zip(names, pauses_s[1:], strict=True):
        samples, source_hz = read_wav(audio_dir / f"{name}.wav")
        parts += [resample(samples, source_hz, rate_hz),
                  np.zeros(round(pause_s * rate_hz), dtype=np.float32)]
    return np.concatenate(parts)


def speech_spans_ms(samples: np.ndarray, rate_hz: int,
                    level: float = SILENCE_LEVEL) -> list[tuple[float, float]]:
    """Where speech is, by an energy gate (no VAD): 10 ms windows whose RMS exceeds `level`
    (-40 dBFS), gaps under `GATE_BRIDGE_MS` bridged; [(start_ms, end_ms)] in order."""
    window = round(GATE_WINDOW_MS * rate_hz / 1000)
    num_windows = len(samples) // window
    rms = np.sqrt(np.mean(samples[: num_windows * window].reshape(num_windows, window) ** 2,
                          axis=1))
    spans: list[list[float]] = []
    for index in np.flatnonzero(rms > level):
        start_ms, end_ms = index * GATE_WINDOW_MS, (index + 1) * GATE_WINDOW_MS
        if spans and start_ms - spans[-1][1] < GATE_BRIDGE_MS:
            spans[-1][1] = end_ms
        else:
            spans.append([start_ms, end_ms])
    return [(float(start), float(end)) for start, end in spans]


def speech_stream(audio_dir: Path, rate_hz: int, duration_s: float, offset: int = 0) -> bytes:
    """`duration_s` of PCM16 at `rate_hz`: the fixtures in turn (from the `offset`-th),
    separated by short silences, looped as needed."""
    paths = sorted(audio_dir.glob("*.wav"))
    if not paths:
        raise FileNotFoundError(f"no .wav files in {audio_dir}")
    gap = np.zeros(round(GAP_S * rate_hz), dtype=np.float32)
    clips = []
    for path in paths:
        samples, source_hz = read_wav(path)
        clips += [resample(samples, source_hz, rate_hz), gap]
    offset_clips = clips[2 * (offset % len(paths)):] + clips[: 2 * (offset % len(paths))]
    one_pass = np.concatenate(offset_clips)
    num_samples = round(duration_s * rate_hz)
    looped = np.tile(one_pass, num_samples // len(one_pass) + 1)[:num_samples]
    return to_pcm16(looped)


def main(out_dir: str) -> None:
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in SENTENCES.items():
        synthesize(text, folder / f"{name}.wav")
        print(folder / f"{name}.wav", (folder / f"{name}.wav").stat().st_size, "bytes")


if __name__ == "__main__":
    main(sys.argv[1])
