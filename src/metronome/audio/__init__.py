"""Audio input: PCM16 wire format, log-mel features, and the front end that turns a
session's audio into input embeddings at the model's token rate (a stand-in encoder with a
text LM; see `frontend`)."""

from metronome.audio.frontend import AudioFormat, AudioFrontEnd, StreamingAudioEncoder
from metronome.audio.pcm import decode_pcm16, encode_pcm16, pcm16_frame_bytes

__all__ = [
    "AudioFormat",
    "AudioFrontEnd",
    "StreamingAudioEncoder",
    "decode_pcm16",
    "encode_pcm16",
    "pcm16_frame_bytes",
]
