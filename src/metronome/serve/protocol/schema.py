"""The session object of the Realtime API (GA), as `session.update` sends it: every field of
OpenAI's schema (the `openai` package's `RealtimeSessionCreateRequest` is the reference, and
`tests/serve/test_serve_conformance.py` walks it against these models), strict, so a field
outside it is `unknown_parameter`.

What each field does here (the README's protocol table says the same):
- honored: `type`, `model` (accepted; the server names the one it serves), `instructions`
  (a system message at that point of the conversation), `output_modalities` (`audio`: the
  Piper voice speaks the reply, where the server has it; else `["text"]`),
  `audio.input.transcription` (Whisper tiny.en, where the server hears),
  `audio.input.format` (PCM16 at a served rate), `truncation` (the session's KV bound within
  the server's ceilings: `serve.realtime.bound`), `audio.input.turn_detection` (`server_vad`;
  `semantic_vad` is served as `server_vad` with its `create_response` and
  `interrupt_response`: no turn-end model is served), `max_output_tokens` (a turn's reply's
  budget, 1-4096 or "inf", within the server's `--max-response-tokens`; `response.create`'s
  overrides it for one reply), the `metronome` extension (mode);
- accepted, not honored (the effective value in `session.updated` says so, and the server logs
  it once per session): `noise_reduction` (no denoiser is served: null), the voice and speed
  of `audio.output` (one voice is served), `tools`,
  `tool_choice`, `parallel_tool_calls` (the served model calls no tools: `[]`, `"none"`),
  `tracing`, `prompt`,
  `include`, `reasoning` (null).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    StrictBool,
    StrictFloat,
    StrictInt,
    model_serializer,
)

MAX_ID_CHARS = 128  # client-chosen ids (event_id, item id); longer ones are refused
MAX_VAD_MS = 60_000  # longest prefix padding or silence a turn detection may ask for

ClientId = Annotated[str, Field(max_length=MAX_ID_CHARS)]
Number = StrictInt | StrictFloat


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---- honored --------------------------------------------------------------------------------
class AudioFormatIn(Strict):
    type: Literal["audio/pcm", "audio/pcmu", "audio/pcma"]  # only PCM16 is served as input
    rate: StrictInt = 24000


class ServerVad(Strict):
    """`server_vad` turn detection, OpenAI's fields and defaults; in `session.update` and, with
    every default filled in, in the session's description."""

    type: Literal["server_vad"]
    threshold: StrictFloat = Field(0.5, ge=0.0, le=1.0)  # P(speech) that starts speech
    prefix_padding_ms: StrictInt = Field(300, ge=0, le=MAX_VAD_MS)  # before speech_started
    silence_duration_ms: StrictInt = Field(500, ge=0, le=MAX_VAD_MS)  # that ends a turn
    create_response: StrictBool = True  # turn mode: a response at each speech stop
    interrupt_response: StrictBool = True  # speech cancels the response under way
    idle_timeout_ms: None = None  # not served: null only


class SemanticVad(Strict):
    """Accepted and served as `server_vad` (no turn-end model is served)."""

    type: Literal["semantic_vad"]
    create_response: StrictBool | None = None
    eagerness: Literal["low", "medium", "high", "auto"] | None = None
    interrupt_response: StrictBool | None = None


# ---- accepted, not honored ------------------------------------------------------------------
class NoiseReduction(Strict):
    type: Literal["near_field", "far_field"] | None = None
    strength: Number | None = None


class Transcription(Strict):
    model: str | None = None
    language: str | None = None
    languages: list[str] | None = None
    prompt: str | None = None
    keywords: list[str] | None = None
    delay: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None


class VoiceId(Strict):
    id: str


class AudioOutputIn(Strict):
    format: AudioFormatIn | None = None
    speed: Number | None = None
    voice: str | VoiceId | None = None


class FunctionTool(Strict):
    type: Literal["function"] | None = None
    name: str | None = None
    description: str | None = None
    parameters: JsonValue = None


class McpTool(Strict):
    type: Literal["mcp"]
    server_label: str
    server_url: str | None = None
    server_description: str | None = None
    connector_id: str | None = None
    authorization: str | None = None
    headers: dict[str, str] | None = None
    allowed_tools: JsonValue = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    require_approval: JsonValue = None
    defer_loading: StrictBool | None = None
    tunnel_id: str | None = None


Tool = Annotated[FunctionTool | McpTool, Field(union_mode="left_to_right")]


class ToolChoiceFunction(Strict):
    type: Literal["function"]
    name: str


class ToolChoiceMcp(Strict):
    type: Literal["mcp"]
    server_label: str
    name: str | None = None


ToolChoice = Literal["none", "auto", "required"] | ToolChoiceFunction | ToolChoiceMcp


class Tracing(Strict):
    group_id: str | None = None
    metadata: JsonValue = None
    workflow_name: str | None = None


class TokenLimits(Strict):
    post_instructions: StrictInt | None = None


class RetentionRatio(Strict):
    type: Literal["retention_ratio"]
    retention_ratio: Number
    token_limits: TokenLimits | None = None


class Prompt(Strict):
    id: str
    variables: dict[str, JsonValue] | None = None
    version: str | None = None


class Reasoning(Strict):
    effort: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None


# ---- the session ----------------------------------------------------------------------------
class AudioInputIn(Strict):
    format: AudioFormatIn | None = None
    # absent: unchanged; null: the client commits (duplex frames or explicit commits)
    turn_detection: Annotated[ServerVad | SemanticVad, Field(discriminator="type")] | None = None
    noise_reduction: NoiseReduction | None = None
    transcription: Transcription | None = None


class AudioIn(Strict):
    input: AudioInputIn | None = None
    output: AudioOutputIn | None = None


class MetronomeSessionIn(Strict):
    mode: Literal["duplex", "turn"] | None = None


class SessionIn(Strict):
    type: Literal["realtime"] = "realtime"
    model: ClientId | None = None  # accepted; the server serves one model and names it
    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] | None = None
    audio: AudioIn | None = None
    max_output_tokens: StrictInt | Literal["inf"] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    tracing: Literal["auto"] | Tracing | None = None
    truncation: Literal["auto", "disabled"] | RetentionRatio | None = None
    prompt: Prompt | None = None
    include: list[Literal["item.input_audio_transcription.logprobs"]] | None = None
    reasoning: Reasoning | None = None
    metronome: MetronomeSessionIn | None = None  # the extension: mode

    def not_honored(self, speaks: bool = False, hears: bool = False) -> list[str]:
        """The fields this update set that the server accepts but does not act on; `speaks`:
        the server has a voice (audio output is served), `hears`: it transcribes audio."""
        fields: list[str] = [name for name in ("tools", "tool_choice", "parallel_tool_calls",
                                               "tracing",
                                    "prompt", "include", "reasoning") if name in
                                  self.model_fields_set]
        if self.output_modalities and "audio" in self.output_modalities and not speaks:
            fields.append("output_modalities (audio)")
        audio = self.audio
        if audio is not None and audio.output is not None:
            if not speaks:
                fields.append("audio.output")
            elif audio.output.voice is not None or audio.output.speed is not None:
                fields.append("audio.output.voice and speed (one voice is served)")
        if audio is not None and audio.input is not None:
            if audio.input.noise_reduction is not None:
                fields.append("audio.input.noise_reduction")
            if audio.input.transcription is not None and not hears:
                fields.append("audio.input.transcription")
            if isinstance(audio.input.turn_detection, SemanticVad):
                fields.append("audio.input.turn_detection (semantic_vad is served as "
                              "server_vad)")
        return fields


# ---- the session as the server describes it -------------------------------------------------
class AudioFormatOut(BaseModel):
    type: Literal["audio/pcm"] = "audio/pcm"
    rate: int


class AudioInputOut(BaseModel):
    format: AudioFormatOut
    turn_detection: ServerVad | None = None
    # what the client asked for, echoed while it is served (Whisper tiny.en, whatever model
    # it names); null: no transcription events
    transcription: Transcription | None = None
    noise_reduction: None = None


class AudioOutputOut(BaseModel):
    format: AudioFormatOut
    voice: str  # the one voice served


class AudioOut(BaseModel):
    input: AudioInputOut
    output: AudioOutputOut | None = None  # None (left out): replies are text

    @model_serializer(mode="wrap")
    def _without_absent_output(self, handler):
        data = handler(self)
        if data.get("output") is None:
            data.pop("output", None)
        return data


class ResumeOut(BaseModel):
    """How to resume this session after a dropped connection (`serve.resume`)."""

    token: str  # resumes once; the resume answers with the next
    grace_s: float  # how long the server holds the session after its client drops


class MetronomeSessionOut(BaseModel):
    mode: Literal["duplex", "turn"]
    frame_period_s: float
    deadline_s: float
    output_tokens_per_frame: int  # duplex: per frame; turn: per response
    policy: str
    token_rate_hz: float
    resume: ResumeOut | None = None  # None: the server does not resume sessions


class SessionOut(BaseModel):
    """The effective session: what is in force, not what was asked for."""

    type: Literal["realtime"] = "realtime"
    object: Literal["realtime.session"] = "realtime.session"
    id: str
    model: str
    instructions: str | None = None
    output_modalities: list[Literal["text", "audio"]] = ["text"]
    audio: AudioOut
    # a turn's reply's budget as the session set it ("inf": the server's --max-response-tokens);
    # a duplex session's: the tokens of each frame's output
    max_output_tokens: int | Literal["inf"]
    tools: list = []
    tool_choice: Literal["none"] = "none"
    # the session's KV bound (serve.realtime.bound): "auto" (the server's), "disabled", or a
    # retention_ratio with the post_instructions limit in force
    truncation: Literal["auto", "disabled"] | RetentionRatio = "auto"
    tracing: None = None
    metronome: MetronomeSessionOut | None = None  # only for a client that opted in

    @model_serializer(mode="wrap")
    def _without_absent_extension(self, handler):
        data = handler(self)
        if data.get("metronome") is None:
            data.pop("metronome", None)
        return data
