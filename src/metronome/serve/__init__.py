"""The Realtime server: the OpenAI Realtime API (GA) over WebSocket, on the beat.

Routes: `GET /healthz` (stall detector, admission, pool; without the key only its status),
`GET /metrics` (Prometheus), `GET /v1/sessions` (live sessions, resident KV, status),
`WS /v1/realtime`. With an API key, everything but `/healthz` needs it: `Authorization:
Bearer <key>`, or from a browser the subprotocol `openai-insecure-api-key.<key>` beside
`realtime` (the accepted WebSocket echoes `realtime`).

Protocol: OpenAI's Realtime API (GA). Every client event type and session field parses
(`serve.protocol`, `serve.protocol.schema`); what the server cannot do is refused by name
(`serve.realtime.session`), what it accepts and does not act on shows as in effect in
`session.updated`. Server events are OpenAI's, in OpenAI's order (`serve.protocol.server`,
`serve.realtime.rendering`). Extensions, for a client that opts in with `?metronome_events=true`:
`session.metronome` (mode: `duplex` | `turn`, frame timing) and `metronome.frame` (every
frame's status and server timing), `metronome.session.bounded`, `metronome.reply`,
`metronome.input.behind`.

Modes. Duplex (default; Moshi, MiniCPM-o): every complete frame of appended audio is one
response, no commit needed. Turn: audio frames only prefill; `response.create` asks for a
reply. Either way a frame is answered exactly once, on time, with the truth: a late frame's
response is `incomplete` (its `metronome.frame`: `late`), a KV-stalled one `failed` (code
`stalled_kv`).

Refusals and closes: a bad or missing key is refused before the upgrade with HTTP 401,
admission with HTTP 503 + `Retry-After` (where the server cannot answer HTTP: an `error`,
then close 1008 or 1013); idle timeout and maximum duration get an `error` then close 1000;
a client over its rate limit (messages/s, bytes/s) has its messages dropped with one `error`
and, if it goes on by a further burst, an `error` then close 1008; a client that stops
reading is closed 1008 (its transport dropped if the close frame cannot go out); messages
over the transport cap close 1009. Every other bad input is an `error` event and the
session goes on unchanged. Before any of this, the transport guard (`serve.edge.guard`) drops
HTTP requests slower than `request_timeout_s` and refuses connections past
`max_connections` with 503.
"""
