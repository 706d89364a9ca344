"""The Realtime server: a subset of the OpenAI Realtime API (GA) over WebSocket, on the beat.

Routes: `GET /healthz` (stall detector, admission, pool; never needs a key), `GET /metrics`
(Prometheus), `GET /v1/sessions` (live sessions, resident KV, status), `WS /v1/realtime`.

Client events: `session.update` (`audio.input.format` `audio/pcm` at a served rate, 24 kHz
by default; extension `session.metronome.mode`: `duplex` | `turn`),
`input_audio_buffer.append` (base64 PCM16), `input_audio_buffer.commit`,
`conversation.item.create` (`input_text`), `response.create`.
Server events: `session.created`, `session.updated`, `input_audio_buffer.committed`,
`conversation.item.added`, `response.created`, `response.output_text.delta`,
`response.done`, `error`, and `metronome.frame` (every frame's status and server timing).

Modes. Duplex (default; Moshi, MiniCPM-o): every complete frame of appended audio is one
response, no commit needed. Turn: audio frames only prefill; `response.create` asks for a
reply. Either way a frame is answered exactly once, on time, with the truth: a late frame's
response is `incomplete` (reason `deadline`), a KV-stalled one `failed` (code `stalled_kv`).

Refusals and closes: admission refuses at the upgrade with HTTP 503 + `Retry-After` (or,
where the server cannot answer HTTP, an `error` then close 1013); a bad or missing bearer key
gets an `error` then close 1008; idle timeout and maximum duration an `error` then close
1000; a client that stops reading close 1008; messages over the transport cap close 1009.
Every other bad input is an `error` event and the session goes on unchanged.
"""
