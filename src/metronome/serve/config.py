"""The server's one config, validated once at the edge (`metronome serve` options).

Lower layers take plain values derived here: a `SessionProfile` per session mode, an
`AudioFormat` per accepted sample rate, an `EngineConfig`.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from metronome.audio.frontend import AudioFormat
from metronome.engine.engine import EngineConfig, check_policy_limits, check_pool_fits
from metronome.kv.residency import ResidencyPolicy
from metronome.runtime.profile import SessionMode, SessionProfile
from metronome.serve.edge.limits import PeerLimits, TransportLimits
from metronome.serve.protocol.bounded_json import DEFAULT_MAX_DEPTH, DEFAULT_MAX_VALUES
from metronome.workload_defaults import (
    BLOCK_SIZE_TOKENS,
    DEADLINE_FRACTION,
    FRAME_PERIOD_S,
    OUTPUT_TOKENS_PER_FRAME,
    POLICY_SPEC,
    POOL_TOKENS,
)

MAX_DEADLINE_FRACTION = 10  # the largest deadline a server takes, in frame periods


class ServerConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # Every field is also a `metronome serve` option (--pool-tokens for pool_tokens, ...): the
    # CLI is generated from these defaults and descriptions, so they live here only.
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    model: str = Field("bundled", description="'bundled', a Hugging Face directory, or "
                       "preset:NAME[:LAYERS]")
    engine: Literal["native", "vllm"] = Field(
        "native", description="native (Metronome's engine) | vllm (vLLM with the sinks+window "
        "plugin, in this process; `make vllm-install`; text input only, one policy)")
    vllm_mode: Literal["default", "eager"] = Field(
        "default", description="--engine vllm: default (vLLM's own: the model compiled; on "
        "CPU vLLM schedules synchronously) | eager (enforce_eager: starts ~4x faster)")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto (bfloat16 where the CPU has native bf16, else float32) | "
        "float32 | bfloat16")
    policy: str = Field(POLICY_SPEC, description="every session's KV bound: "
                        "unbounded | window:W | sinks_window:S:W, optionally @rolling")
    pool_tokens: int = Field(POOL_TOKENS, ge=16, description="KV pool size in tokens")
    # A session may choose its own bound (session.truncation: serve.realtime.bound) within these.
    max_window_tokens: int = Field(2048, ge=1, description="the largest window a session may "
                                   "choose (session.truncation's post_instructions)")
    max_pinned_tokens: int = Field(512, ge=1, description="the largest pinned prefix: a "
                                   "session's instructions (as a system message) are its sinks; "
                                   "longer ones are refused")
    allow_unbounded_sessions: bool = Field(False, description="sessions may choose "
                                           "session.truncation \"disabled\" (no bound, up to "
                                           "the model's trained positions)")
    session_reservation_tokens: int | None = Field(
        None, ge=1, description="KV tokens admission counts per session for its memory "
        "ceiling (default: what a session under --policy holds at its peak); sessions that "
        "choose larger bounds or pin long instructions hold more")
    degrade_policy: str | None = Field(
        None, description="opt-in graceful degradation: when the KV pool runs dry, switch "
        "unbounded sessions (largest first) to this bound, e.g. sinks_window:4:512, freeing "
        "their middle blocks and telling each client (metronome.session.bounded); off by "
        "default")
    prefill_chunk_tokens: int = Field(
        EngineConfig.max_prefill_chunk_tokens, ge=1, description="the largest piece of a "
        "long prompt the engine takes in one step while no real-time session is live "
        "(native engine; 64, a frame's chunk, turns the large chunks off)")
    block_size: int = Field(BLOCK_SIZE_TOKENS, ge=1, description="KV block size in tokens "
                            "(--engine vllm: 32 unless given; its CPU attention needs a "
                            "multiple of 32)")
    frame_period_s: float = Field(FRAME_PERIOD_S, ge=0.01, le=60,
                                  description="audio is cut into frames of this length")
    deadline_fraction: float = Field(DEADLINE_FRACTION, gt=0, le=MAX_DEADLINE_FRACTION,
                                     description="deadline = fraction x frame period")
    turn_deadline_s: float = Field(2.0, gt=0, description="turn mode: a frame's deadline is "
                                   "at least this (a reply's runs from response.create and "
                                   "covers hearing the turn's end, ~0.35-0.5 s of Whisper on "
                                   "2 cores, and the reply's tokens)")
    output_tokens_per_frame: int = Field(OUTPUT_TOKENS_PER_FRAME, ge=1,
                                         description="duplex: tokens per frame")
    max_response_tokens: int = Field(256, ge=1, description="turn: the most tokens of one "
                                     "reply (a client's max_output_tokens, \"inf\" unless "
                                     "it says, is honoured up to this); a reply ends at the "
                                     "model's stop or its budget, never at a deadline")
    text_pace_tokens_per_s: float = Field(8.0, gt=0, description="turn: the reading pace a "
                                          "text reply is measured against (~6 words/s, a "
                                          "fast reader): text sent slower than this leaves "
                                          "its reader waiting, a gap")
    speak_order: Literal["deadline", "arrival"] = Field(
        "deadline", description="the speak stage's order: deadline (each sentence when its "
        "reply's listener would run dry: a reply far ahead yields to one about to run dry) "
        "or arrival (first asked, first spoken: as before, for comparison)")
    mode: SessionMode = Field(SessionMode.TURN, description="default session mode: turn (a "
                              "reply per turn, what Realtime clients expect) | duplex (output "
                              "every frame, Moshi-like; a session may choose with "
                              "session.update)")
    audio_input: Literal["transcribe", "embeddings"] = Field(
        "transcribe", description="what a turn session's audio becomes: transcribe (Whisper "
        "tiny.en as it arrives; the words enter the KV as the user's message) | embeddings "
        "(the stand-in front end: one KV entry per audio token, as an omni encoder; duplex "
        "sessions always use it)")
    output_audio: bool = Field(True, description="sessions answer aloud by default "
                               "(output_modalities [\"audio\"], the Piper voice); off: text, "
                               "until a session asks for audio")
    server_vad: bool = Field(True, description="sessions start with server VAD turn "
                             "detection (OpenAI's default); off: the client commits")
    whisper_threads: int = Field(1, ge=1, le=64, description="CPU threads of one Whisper "
                                 "pass (on the encoder thread; the rest are the engine's)")
    whisper_window_s: float = Field(
        10.0, ge=1.0, le=30.0, description="the least a Whisper pass hears: max(turn, this) "
        "seconds (30: every pass 30 s, as faster-whisper's transcribe() pads; 10 costs ~3-5x "
        "less at the same word error: `metronome bench ear`)")
    hear_ahead_pause_ms: float = Field(
        200.0, ge=0, description="a pause in a turn's speech this long runs the turn's last "
        "Whisper pass at once, in the silence that may end the turn (server VAD's "
        "silence_duration_ms, 500 by default): a turn that ends there is heard one pass "
        "sooner; 0: off (the last pass runs at the commit)")
    max_turn_s: float = Field(
        120.0, gt=0, description="server VAD's turn limit: speech that goes on this long "
        "without a pause is committed and answered there, and what follows is a new turn "
        "that does not barge in on that answer (a television in the room gets answers)")
    sample_rates_hz: tuple[int, ...] = Field((16000, 24000, 48000),
                                             description="accepted audio/pcm rates")
    default_sample_rate_hz: int = Field(24000, description="input rate until a session "
                                        "says otherwise (the OpenAI Realtime default)")
    token_rate_hz: float = Field(12.5, gt=0, description="audio tokens per second (Moshi: "
                                 "12.5)")
    admission: Literal["aimd", "static", "off"] = Field(
        "aimd", description="admission at connect: aimd (cap starts at --admission-cap) | "
        "static (fixed cap) | off")
    admission_cap: int = Field(4, ge=1, description="aimd: initial cap; static: the cap")
    admission_interval_s: float = Field(2.0, gt=0, description="AIMD control interval")
    api_key: SecretStr | None = Field(None, description="require this bearer key everywhere "
                                      "but /healthz (prefer the METRONOME_API_KEY variable)")
    # Limits on what one client may do; each breach is answered with an `error` event.
    max_message_bytes: int = Field(520 << 10, ge=1024, description="largest client message "
                                   "(520 KiB: the largest append the default buffer accepts, "
                                   "4 s of 48 kHz audio in base64, with room for its JSON)")
    max_buffered_audio_s: float = Field(4.0, gt=0, description="unanswered audio a session "
                                        "may send ahead of real time; more is refused")
    max_behind_audio_s: float = Field(
        30.0, gt=0, description="unanswered audio kept for a client sending at real time "
        "while the server is behind (told with metronome.notice server_behind, counted, "
        "and seen by admission); only past this is its audio refused")
    max_text_chars: int = Field(8192, ge=1, description="longest text item")
    max_queued_input_tokens: int = Field(
        16384, ge=64, description="input tokens a session may have accepted but not yet "
        "processed, late frames' leftover input and context included (a turn session's text "
        "items and instructions: a history of 50 items of 200 words restored at once fits); "
        "more is refused")
    idle_timeout_s: float | None = Field(None, gt=0, description="close a session whose "
                                         "client sent nothing this long (off by default: a "
                                         "quiet session is healthy, and a half-open socket "
                                         "is found by the WebSocket pings)")
    max_session_s: float = Field(3600.0, gt=0, description="close a session this old "
                                 "(OpenAI's limit is 60 min as well)")
    resume_grace_s: float = Field(30.0, ge=0, le=3600, description="hold a session this "
                                  "long after its connection drops, for its client to resume "
                                  "it (the resume token is in session.created's metronome "
                                  "block); 0: a dropped session ends at once")
    checkpoint_interval_s: float = Field(5.0, ge=0, le=3600, description="on a cluster "
                                         "(--replicas), checkpoint each bounded session to "
                                         "the session store at most this often, so another "
                                         "replica can resume it (replaying the input since); "
                                         "0: never (a replica's sessions die with it)")
    max_outbox_events: int = Field(4096, ge=16, description="server events a slow reader "
                                   "may leave queued before it is closed 1008")
    max_outbox_bytes: int = Field(1 << 20, ge=1 << 16, description="bytes of server events "
                                  "a slow reader may leave queued before it is closed 1008")
    # The cost of one message is bounded before it is parsed (serve.protocol.bounded_json).
    max_message_values: int = Field(DEFAULT_MAX_VALUES, ge=64, description="JSON values one "
                                    "message may hold (each object member and array item; 64 "
                                    "text parts take ~200); more is refused unparsed")
    max_message_depth: int = Field(DEFAULT_MAX_DEPTH, ge=5, description="deepest JSON nesting "
                                   "of a message (session.update's audio format is 5 deep)")
    # Per connection, token buckets; 100 ms appends of 48 kHz audio are 10 msg/s, ~130 kB/s.
    rate_limit_messages_per_s: float = Field(100.0, gt=0, description="client messages per "
                                             "second per connection; over it they are dropped "
                                             "(one error), a further burst over it closes 1008 "
                                             "(WebSocket pings and continuation frames: a "
                                             "bucket of their own, past it the transport is "
                                             "dropped)")
    rate_limit_burst_messages: int = Field(200, ge=1, description="messages a connection may "
                                           "send at once above the rate")
    rate_limit_bytes_per_s: int = Field(512 << 10, ge=1024, description="client bytes per "
                                        "second per connection, as for messages")
    rate_limit_burst_bytes: int = Field(2 << 20, ge=1024, description="bytes a connection may "
                                        "send at once above the rate (at least "
                                        "max_message_bytes)")
    # The transport, before any handler runs (serve.edge.guard).
    request_timeout_s: float = Field(10.0, gt=0, description="an HTTP request (line, headers, "
                                     "body) must arrive within this long of its first byte, "
                                     "a new connection's first one within this long of the "
                                     "connect; slower ones are dropped (slowloris)")
    max_header_bytes: int = Field(16 << 10, ge=1024, description="largest HTTP request line "
                                  "plus headers; larger ones are answered 431")
    max_connections: int = Field(512, ge=2, description="open TCP connections on the client "
                                 "port, WebSockets included; at the cap a new one takes the "
                                 "place of the quietest connection that has not completed a "
                                 "request, else it is answered 503 at once and closed")
    near_cap_fraction: float = Field(0.75, gt=0, le=1, description="once this share of "
                                     "max_connections is open, a new connection must send "
                                     "its first request within near_cap_handshake_s")
    near_cap_handshake_s: float = Field(1.0, gt=0, description="the first request's deadline "
                                        "for a connection opened near the cap")
    health_port: int | None = Field(None, ge=0, le=65535, description="the health listener's "
                                    "port (/healthz, /readyz, /metrics only, a connection "
                                    "budget of its own: point probes here); default: port + 1 "
                                    "(a free port when port is 0)")
    health_host: str | None = Field(None, description="the health listener's address "
                                    "(default: host)")
    health_max_connections: int = Field(16, ge=1, description="open connections on the health "
                                        "listener; one more is answered 503")
    resumes_per_s: float = Field(20.0, gt=0, description="resume attempts per second the "
                                 "server takes from all clients; faster ones are answered "
                                 "429 before any work")
    resume_burst: int = Field(40, ge=1, description="resume attempts the server takes at once "
                              "above that rate")
    resumes_per_s_per_peer: float = Field(1.0, gt=0, description="resume attempts per second "
                                          "one peer may make")
    resume_burst_per_peer: int = Field(8, ge=1, description="resume attempts a peer may make "
                                       "at once above that rate")
    max_leases_per_peer: int = Field(16, ge=0, description="sessions of one peer held for a "
                                     "resume at once (each also counts against its "
                                     "max_connections_per_peer); a dropped session past it "
                                     "ends at once")
    # Per peer (one client address; IPv6: its /64), before the upgrade (serve.edge.peers).
    max_connections_per_peer: int = Field(128, ge=1, description="open connections one "
                                          "peer may hold; one more is answered 503 with "
                                          "Retry-After at once and closed")
    connections_per_s_per_peer: float = Field(32.0, gt=0, description="new connections per "
                                              "second one peer may open; faster ones are "
                                              "answered 429 with Retry-After")
    connection_burst_per_peer: int = Field(64, ge=1, description="new connections a peer may "
                                           "open at once above that rate")
    trusted_proxies: tuple[str, ...] = Field((), description="addresses of reverse proxies "
                                             "whose forwarded-for header names the peer (at "
                                             "the upgrade); from anyone else the header is "
                                             "ignored and the socket's address is the peer")
    forwarded_for_header: str = Field("x-forwarded-for", min_length=1, description="the "
                                      "header trusted proxies name the client in (the "
                                      "rightmost address that is not a trusted proxy)")

    @field_validator("trusted_proxies")
    @classmethod
    def _normalized_addresses(cls, addresses: tuple[str, ...]) -> tuple[str, ...]:
        """As a socket reports its peer (`::1`, not `0:0:0:0:0:0:0:1`); refused if not IPs."""
        return tuple(str(ipaddress.ip_address(address)) for address in addresses)

    @model_validator(mode="before")
    @classmethod
    def _engine_defaults(cls, data):
        if isinstance(data, dict) and data.get("engine") == "vllm" and "block_size" not in data:
            data = data | {"block_size": 32}
        return data

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        policy, engine = ResidencyPolicy.parse(self.policy), self.engine_config()
        if policy.window_tokens is not None and (policy.window_tokens > self.max_window_tokens
                                                 or policy.sink_tokens > self.max_pinned_tokens):
            raise ValueError(f"the default bound {policy} passes the ceilings a session may "
                             f"choose within (--max-window-tokens {self.max_window_tokens}, "
                             f"--max-pinned-tokens {self.max_pinned_tokens})")
        check_policy_limits(policy, engine)
        check_pool_fits(policy, engine, self.pool_tokens // self.block_size)
        if engine.pressure_policy is not None:
            check_policy_limits(engine.pressure_policy, engine)
            check_pool_fits(engine.pressure_policy, engine, self.pool_tokens // self.block_size)
        if self.engine == "vllm" and self.block_size % 32:
            raise ValueError(f"--engine vllm: block_size {self.block_size} is not a multiple of "
                             "32 (vLLM's CPU attention needs one)")
        if self.engine == "vllm" and (self.degrade_policy is not None
                                      or self.model.startswith("preset:")):
            raise ValueError("--engine vllm serves a model directory ('bundled' or a Hugging "
                             "Face directory) without degrade_policy (the vLLM plugin has one "
                             "bound per engine)")
        if self.default_sample_rate_hz not in self.sample_rates_hz:
            raise ValueError(f"default_sample_rate_hz ({self.default_sample_rate_hz}) must be "
                             f"one of sample_rates_hz {self.sample_rates_hz}")
        token_period_s = 1 / self.token_rate_hz
        if self.frame_period_s < token_period_s - 1e-9:
            raise ValueError(
                f"frame_period_s ({self.frame_period_s}) must hold at least one audio token "
                f"({token_period_s:g} s at {self.token_rate_hz} Hz)"
            )
        if self.max_buffered_audio_s < 2 * self.frame_period_s:
            raise ValueError(f"max_buffered_audio_s ({self.max_buffered_audio_s}) must be at "
                             f"least two frame periods (2 x {self.frame_period_s} s)")
        for rate_hz in self.sample_rates_hz:
            self.audio_format(rate_hz).frame_bytes(self.frame_period_s)
        health_port = self.health_address()[1]
        if health_port > 65535:
            raise ValueError(f"port {self.port} leaves no port + 1 for the health listener: "
                             "give --health-port")
        if health_port != 0 and health_port == self.port:
            raise ValueError(f"health_port {health_port} is the client port: the health "
                             "listener needs a port of its own")
        if self.rate_limit_burst_bytes < self.max_message_bytes:
            raise ValueError(f"rate_limit_burst_bytes ({self.rate_limit_burst_bytes}) must be "
                             f"at least max_message_bytes ({self.max_message_bytes})")
        return self

    def transport_limits(self) -> TransportLimits:
        """What `serve.edge.guard` enforces before any handler runs."""
        peers = PeerLimits(self.max_connections_per_peer, self.connections_per_s_per_peer,
                           self.connection_burst_per_peer, frozenset(self.trusted_proxies),
                           self.forwarded_for_header.lower().encode("latin-1"),
                           self.max_leases_per_peer, self.resumes_per_s_per_peer,
                           self.resume_burst_per_peer)
        return TransportLimits(self.request_timeout_s, self.max_header_bytes,
                               self.max_connections, self.rate_limit_messages_per_s,
                               self.rate_limit_burst_messages, peers,
                               self.near_cap_fraction, self.near_cap_handshake_s,
                               self.resumes_per_s, self.resume_burst,
                               self.health_max_connections)

    def health_address(self) -> tuple[str, int]:
        """Where the health listener binds."""
        port = self.health_port
        if port is None:
            port = 0 if self.port == 0 else self.port + 1
        return self.health_host or self.host, port

    def audio_format(self, sample_rate_hz: int) -> AudioFormat:
        return AudioFormat(sample_rate_hz=sample_rate_hz, token_rate_hz=self.token_rate_hz)

    def profile(self, mode: SessionMode) -> SessionProfile:
        duplex = mode is SessionMode.DUPLEX
        fraction = self.deadline_fraction if duplex else min(MAX_DEADLINE_FRACTION, max(
            self.deadline_fraction, self.turn_deadline_s / self.frame_period_s))
        return SessionProfile(
            frame_period_s=self.frame_period_s,
            deadline_fraction=fraction,
            max_output_tokens_per_frame=(
                self.output_tokens_per_frame if duplex else self.max_response_tokens
            ),
            mode=mode,
            policy=ResidencyPolicy.parse(self.policy),
            max_queued_input_tokens=self.max_queued_input_tokens,
        )

    def engine_config(self) -> EngineConfig:
        pressure = None if self.degrade_policy is None else ResidencyPolicy.parse(
            self.degrade_policy)
        return EngineConfig(block_size=self.block_size, pool_tokens=self.pool_tokens,
                            pressure_policy=pressure,
                            max_prefill_chunk_tokens=self.prefill_chunk_tokens,
                            # a turn's reply, or a duplex frame's answer: held for a rewind
                            max_reply_tokens=max(self.max_response_tokens,
                                                 self.output_tokens_per_frame),
                            max_window_tokens=self.max_window_tokens,
                            max_sink_tokens=self.max_pinned_tokens)

    @property
    def ws_max_message_bytes(self) -> int:
        """The transport's hard cap: larger messages are closed with 1009 by uvicorn before
        they reach us; between `max_message_bytes` and this, we answer an `error` event."""
        return 4 * self.max_message_bytes
