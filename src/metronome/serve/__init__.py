"""The Realtime server: a subset of the OpenAI Realtime API (GA) over WebSocket, on the beat.

Routes: `GET /healthz` (stall detector, admission, pool; without the key only its status),
`GET /metrics` (Prometheus), `GET /v1/sessions` (live sessions, resident KV, status),
`WS /v1/realtime`. With an API key, everything but `/healthz` needs it: `Authorization:
Bearer <key>`, or from a browser the subprotocol `openai-insecure-api-key.<key>` beside
`realtime` (the accepted WebSocket echoes `realtime`).

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

Refusals and closes: a bad or missing key is refused before the upgrade with HTTP 401,
admission with HTTP 503 + `Retry-After` (where the server cannot answer HTTP: an `error`,
then close 1008 or 1013); idle timeout and maximum duration get an `error` then close 1000;
a client over its rate limit (messages/s, bytes/s) has its messages dropped with one `error`
and, if it goes on by a further burst, an `error` then close 1008; a client that stops
reading is closed 1008 (its transport dropped if the close frame cannot go out); messages
over the transport cap close 1009. Every other bad input is an `error` event and the
session goes on unchanged. Before any of this, the transport guard (`serve.guard`) drops
HTTP requests slower than `request_timeout_s` and refuses connections past
`max_connections` with 503.
"""
