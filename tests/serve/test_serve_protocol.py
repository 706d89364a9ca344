"""The wire protocol, frame cutting, detokenization and config: exact, no server."""

from __future__ import annotations

import json

import pytest
import torch
from pydantic import ValidationError

from metronome.audio.frontend import AudioFormat, AudioFrontEnd
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import ClientError, ErrorCode
from metronome.serve.realtime.audio_input import AudioFramer
from metronome.serve.realtime.chat import DeltaDecoder
from tests.served import TEXT_DUPLEX


def error_of(message: str) -> ClientError:
    with pytest.raises(ClientError) as caught:
        p.parse_client_event(message)
    return caught.value


@pytest.mark.parametrize(("message", "code", "param"), [
    ("{", ErrorCode.INVALID_JSON, None),
    ("[1, 2]", ErrorCode.INVALID_JSON, None),
    ("[" * 100_000, ErrorCode.INVALID_JSON, None),
    ('{"type": {"a": 1}}', ErrorCode.UNKNOWN_EVENT_TYPE, "type"),
    ('{"type": "response.frobnicate"}', ErrorCode.UNKNOWN_EVENT_TYPE, "type"),
    ('{"type": "session.update"}', ErrorCode.MISSING_PARAMETER, "session"),
    ('{"type": "session.update", "session": {"voice": "alloy"}}', ErrorCode.UNKNOWN_PARAMETER,
     "session.voice"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": '
     '{"type": "audio/flac"}}}}}', ErrorCode.INVALID_VALUE, "session.audio.input.format.type"),
    ('{"type": "session.update", "session": {"audio": {"input": {"format": '
     '{"type": "audio/pcm", "rate": "24000"}}}}}', ErrorCode.INVALID_VALUE,
     "session.audio.input.format.rate"),
    ('{"type": "session.update", "session": {"output_modalities": ["video"]}}',
     ErrorCode.INVALID_VALUE, "session.output_modalities.0"),
    ('{"type": "input_audio_buffer.append", "audio": 7}', ErrorCode.INVALID_VALUE, "audio"),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "developer", '
     '"content": [{"type": "input_text", "text": "hi"}]}}', ErrorCode.INVALID_VALUE, "item.role"),
    ('{"type": "conversation.item.create", "item": {"type": "message", "role": "user", '
     '"content": []}}', ErrorCode.INVALID_VALUE, "item.content"),
])
def test_malformed_events_get_exact_codes_and_params(message, code, param):
    err = error_of(message)
    assert (err.code, err.param) == (code, param)


def test_valid_events_parse_into_their_types():
    event = p.parse_client_event(json.dumps({
        "type": "session.update", "event_id": "evt_1", "session": {
            "type": "realtime", "output_modalities": ["text"], "metronome": {"mode": "turn"},
            "audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000},
                                "turn_detection": None}}}}))
    assert isinstance(event, p.SessionUpdate) and event.event_id == "evt_1"
    assert event.session.audio.input.format.rate == 16000
    assert isinstance(p.parse_client_event('{"type": "response.create"}'), p.ResponseCreate)


def test_error_event_has_openai_shape_and_echoes_the_client_event_id():
    message = '{"type": "nope", "event_id": "evt_7"}'
    err = error_of(message)
    event = p.ErrorEvent.of(err, err.event_id)
    wire = json.loads(event.to_json())
    assert wire["type"] == "error" and wire["event_id"].startswith("event_")
    assert wire["error"] == {"type": "invalid_request_error", "code": "unknown_event_type",
                             "message": wire["error"]["message"], "param": "type",
                             "event_id": "evt_7"}


def framer(frame_period_s: float) -> AudioFramer:
    frontend = AudioFrontEnd(AudioFormat(), hidden_size=16, embed_rms=1.0)
    return AudioFramer(frontend, frame_period_s)


def test_frames_are_cut_at_the_period_whatever_the_chunking():
    audio = (torch.randn(24000 * 3, generator=torch.Generator().manual_seed(0)) * 3000)
    pcm = audio.to(torch.int16).numpy().astype("<i2").tobytes()
    cutter = framer(1.0)
    whole = [(end_ms, cutter.encode(frame)) for frame, end_ms in cutter.cut(pcm)]
    chunked, cutter = [], framer(1.0)
    for offset in range(0, len(pcm), 4800 * 2 - 2):  # odd-sized chunks of whole samples
        chunked += [(end_ms, cutter.encode(frame))
                    for frame, end_ms in cutter.cut(pcm[offset: offset + 4800 * 2 - 2])]
    assert [audio_end_ms for audio_end_ms, _ in whole] == [1000.0, 2000.0, 3000.0]
    assert [audio_end_ms for audio_end_ms, _ in chunked] == [1000.0, 2000.0, 3000.0]
    assert [emb.shape[0] for _, emb in whole] == [12, 13, 12]  # 12.5 tokens per second
    for (_, a), (_, b) in zip(whole, chunked, strict=True):
        torch.testing.assert_close(a, b)


def test_a_final_cut_pads_the_partial_frame_to_whole_tokens():
    cutter = framer(1.0)
    assert cutter.cut(b"\x01\x00" * 2000) == []  # 83 ms: one token and a bit
    rest, audio_end_ms = cutter.cut_rest()
    assert audio_end_ms == pytest.approx(2000 / 24)
    assert cutter.encode(rest, final=True).shape[0] == 2  # final: the bit padded to a token
    assert cutter.encode(cutter.cut_rest()[0], final=True).shape[0] == 0  # nothing left
    other = framer(1.0)  # the same audio not final: the partial token waits for more
    other.cut(b"\x01\x00" * 2000)
    assert other.encode(other.cut_rest()[0]).shape[0] == 1


def test_delta_decoder_holds_split_characters():
    from metronome.model.weights import load_tokenizer

    tokenizer = load_tokenizer()
    ids = tokenizer.encode("naïve café ☕ done").ids
    decoder = DeltaDecoder(tokenizer)
    deltas = [decoder.push([token]) for token in ids] + [decoder.flush()]
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "" in deltas[:-1]  # the coffee cup spans three tokens: two were held back
    assert all("\ufffd" not in d for d in deltas)


def test_config_is_validated_at_the_edge():
    duplex = ServerConfig(**TEXT_DUPLEX)
    assert duplex.profile(duplex.mode).max_output_tokens_per_frame == 4
    with pytest.raises(ValidationError):
        ServerConfig(policy="window:x")
    with pytest.raises(ValidationError):
        ServerConfig(policy="sinks_window:4:100000")  # the engine refuses such sessions
    with pytest.raises(ValidationError):
        ServerConfig(frame_period_s=0.04)  # shorter than one 80 ms audio token
    with pytest.raises(ValidationError):
        ServerConfig(sample_rates_hz=(22050, 24000))  # a 10 ms hop is 220.5 samples
    with pytest.raises(ValidationError):
        ServerConfig(max_buffered_audio_s=1.0)  # less than two 1 s frames
