"""Prometheus metrics: owns every metric name and the registry they are written to.

The registry is injected. `Metrics()` without one builds a private throwaway registry, never
the process-global default: that is the do-nothing default for code that does not care (the
numbers are recorded and dropped with the object; nothing is exported unless someone calls
`render`). One class instead of a parallel `NullMetrics` keeps the method list in one place.

Goodput, the headline number: a frame is *good* when it produced output within its deadline
(`deadline_met and num_tokens > 0`), or met its deadline when no output was expected (e.g. a
listening frame). `metronome_goodput_ratio` is the share of good frames among the last
`goodput_window_frames` frames (all sessions), computed at scrape time; NaN before any frame.
"""

from __future__ import annotations

import math
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from metronome.observe.stall_detector import Health

# Counters are declared by their exposed name; prometheus_client names the family without
# `_total` and adds it back to the sample.
FRAME_LATENCY_SECONDS = "metronome_frame_latency_seconds"
FRAMES_TOTAL = "metronome_frames_total"
FRAME_TOKENS = "metronome_frame_tokens"
GOODPUT_RATIO = "metronome_goodput_ratio"
GOOD_FRAMES_TOTAL = "metronome_good_frames_total"
LATE_TOKENS_TOTAL = "metronome_late_tokens_total"
KV_POOL_BLOCKS = "metronome_kv_pool_blocks"
KV_POOL_SATURATION_ETA_SECONDS = "metronome_kv_pool_saturation_eta_seconds"
KV_PRESSURE_BOUNDED_TOTAL = "metronome_kv_pressure_bounded_sessions_total"
SESSIONS_ACTIVE = "metronome_sessions_active"
SESSIONS_TOTAL = "metronome_sessions_total"
ADMISSION_CAP = "metronome_admission_cap"
ADMISSION_MEMORY_CEILING = "metronome_admission_memory_ceiling"
ADMISSION_SIGNAL = "metronome_admission_latency_fraction"
ADMISSION_DECISIONS_TOTAL = "metronome_admission_decisions_total"
ENGINE_STEP_SECONDS = "metronome_engine_step_seconds"
STEP_BATCH_FRAMES = "metronome_step_batch_frames"
HEALTH_STATE = "metronome_health_state"
SESSION_RESUMES_TOTAL = "metronome_session_resumes_total"
SESSION_LEASES_ENDED_TOTAL = "metronome_session_leases_ended_total"
SESSIONS_LEASED = "metronome_sessions_leased"
SESSION_LEASES_REFUSED_TOTAL = "metronome_session_leases_refused_total"
DOOR_CONNECTIONS = "metronome_door_connections"
DOOR_HALF_OPEN = "metronome_door_half_open_connections"
DOOR_REFUSALS_TOTAL = "metronome_door_refusals_total"
SESSION_RESUME_SECONDS = "metronome_session_resume_seconds"
SESSION_CHECKPOINTS_TOTAL = "metronome_session_checkpoints_total"
SESSION_MIGRATIONS_TOTAL = "metronome_session_migrations_total"
SESSION_CHECKPOINT_BYTES = "metronome_session_checkpoint_bytes"
SESSION_CHECKPOINT_SECONDS = "metronome_session_checkpoint_seconds"
SESSION_AWAY_SECONDS = "metronome_session_away_seconds"
VOICE_STAGE_SECONDS = "metronome_voice_stage_seconds"
INPUT_BEHIND_CHUNKS = "metronome_input_behind_chunks_total"
INPUT_BEHIND_STRETCHES = "metronome_input_behind_total"
REPLY_GAPS = "metronome_reply_gaps_total"
REPLY_GAP_SECONDS = "metronome_reply_gap_seconds"
REPLIES = "metronome_replies_total"

# Statuses whose series exist from the start (at 0), so rate() works before the first event.
# Other status values are accepted and get their own series.
# metronome.stream.FrameStatus values (spelled out: this module does not import the record)
FRAME_STATUSES = ("ok", "late", "stalled_kv", "context_full", "rejected", "cancelled")
POOL_STATES = ("used", "free", "pinned")  # pinned blocks are a subset of used

# 1-2-5 steps from 1 ms to 5 s: Moshi frames are 80 ms, Omni chunks 1-2 s, the wall ~1.6 s.
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
AWAY_BUCKETS_S = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300)
STAGE_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0)
RESUME_OUTCOMES = ("resumed", "restored", "refused_token", "refused_draining", "refused_off",
                   "refused_pool")
# stored; generating (skipped: a frame's tokens still coming); refused (another server has
# the session, or the store is full); unbounded (never checkpointed)
CHECKPOINT_OUTCOMES = ("stored", "generating", "refused", "unbounded")
CHECKPOINT_BYTES_BUCKETS = tuple(float(1 << k) for k in range(16, 31, 2))  # 64 KiB .. 1 GiB
# How a lease usually ends (any session outcome may end one): declared so the series exist at 0
LEASE_OUTCOMES = ("resumed", "lease_expired", "drained")


class Metrics:
    def __init__(
        self, registry: CollectorRegistry | None = None, goodput_window_frames: int = 1000
    ) -> None:
        if goodput_window_frames < 1:
            raise ValueError(f"goodput_window_frames must be >= 1, got {goodput_window_frames}")
        self.registry = registry if registry is not None else CollectorRegistry()
        self._good_window: deque[bool] = deque()
        self._goodput_window_frames = goodput_window_frames
        self._num_good_in_window = 0
        self._declare_frame_metrics()
        self._declare_state_metrics()
        self._declare_resume_metrics()
        self._input_behind_chunks = Counter(
            INPUT_BEHIND_CHUNKS, "Chunks of audio a client sent at real time that the server "
            "kept past --max-buffered-audio-s unanswered: the server was behind its input "
            "(audio ahead of real time is refused instead).", registry=self.registry)
        self._input_behind_stretches = Counter(
            INPUT_BEHIND_STRETCHES, "Stretches a session's real-time audio waited past the "
            "buffer bound (each told once as metronome.input.behind).", registry=self.registry)
        self._reply_gaps = Counter(
            REPLY_GAPS, "Times a reply's listener ran dry before its next piece arrived (a "
            "spoken reply's audio played at real time; a text reply read at the server's "
            "text pace): a gap the listener hears, never a reason to cut the reply.",
            ["output"], registry=self.registry)
        self._reply_gap_seconds = Histogram(
            REPLY_GAP_SECONDS, "How long each gap in a reply lasted.", ["output"],
            buckets=STAGE_BUCKETS_S, registry=self.registry)
        self._replies_with_gaps = Counter(
            REPLIES, "Replies closed, by output and whether any gap was heard.",
            ["output", "gaps"], registry=self.registry)
        self._voice_stage = Histogram(
            VOICE_STAGE_SECONDS, "Time of each stage of a voice frame: encoder (one Whisper "
            "pass that ran: shed and skipped ones are not counted), lm (a response frame, "
            "first input step to its answer), voice (Piper, one sentence).", ["stage"],
            buckets=STAGE_BUCKETS_S, registry=self.registry)

    def _declare_frame_metrics(self) -> None:
        reg = self.registry
        self._frame_latency = Histogram(
            FRAME_LATENCY_SECONDS, "Frame complete at server to result ready.",
            buckets=LATENCY_BUCKETS_S, registry=reg,
        )
        self._frames = Counter(FRAMES_TOTAL, "Finished frames by status.", ["status"],
                               registry=reg)
        for status in FRAME_STATUSES:
            self._frames.labels(status)
        self._frame_tokens = Histogram(FRAME_TOKENS, "Tokens produced per frame.",
                                       buckets=TOKEN_BUCKETS, registry=reg)
        self._good_frames = Counter(GOOD_FRAMES_TOTAL, "Frames with output within the deadline.",
                                    registry=reg)
        self._late_tokens = Counter(LATE_TOKENS_TOTAL,
                                    "Tokens produced after their frame's result went out.",
                                    registry=reg)
        goodput = Gauge(GOODPUT_RATIO, "Good share of the last frames (see module doc).",
                        registry=reg)
        goodput.set_function(self.goodput_ratio)

    def _declare_state_metrics(self) -> None:
        reg = self.registry
        self._pool_blocks = Gauge(KV_POOL_BLOCKS, "KV pool blocks by state.", ["state"],
                                  registry=reg)
        for state in POOL_STATES:
            self._pool_blocks.labels(state)
        self._saturation_eta = Gauge(KV_POOL_SATURATION_ETA_SECONDS,
                                     "Forecast seconds until the KV pool is full (+Inf: never).",
                                     registry=reg)
        self._saturation_eta.set(float("inf"))
        self._sessions_active = Gauge(SESSIONS_ACTIVE, "Open sessions.", registry=reg)
        self._pressure_bounded = Counter(
            KV_PRESSURE_BOUNDED_TOTAL, "Unbounded sessions bound to the degrade policy because "
            "the KV pool ran dry (graceful degradation).", registry=reg)
        self._sessions = Counter(SESSIONS_TOTAL, "Closed sessions by outcome.", ["outcome"],
                                 registry=reg)
        self._admission_cap = Gauge(ADMISSION_CAP, "Sessions the controller admits now.",
                                    registry=reg)
        self._memory_ceiling = Gauge(
            ADMISSION_MEMORY_CEILING, "Sessions of the server's bound the KV pool holds at "
            "their peak: admission never goes past it (+Inf: no ceiling, unbounded KV).",
            registry=reg)
        self._memory_ceiling.set(float("inf"))
        self._step_seconds = Histogram(ENGINE_STEP_SECONDS, "Wall time of one engine step.",
                                       buckets=LATENCY_BUCKETS_S, registry=reg)
        self._batch_frames = Histogram(STEP_BATCH_FRAMES, "Frames served by one engine step.",
                                       buckets=BATCH_BUCKETS, registry=reg)
        self._admission_decisions = Counter(
            ADMISSION_DECISIONS_TOTAL, "Session opens by decision: admitted or refused_<reason>.",
            ["decision"], registry=reg)
        self._admission_signal = Gauge(
            ADMISSION_SIGNAL, "The `quantile` of latency / deadline in the last control "
            "interval: the signal the admission controller acted on (NaN: no frames).",
            ["quantile"], registry=reg)
        self._health = Gauge(HEALTH_STATE, "0 ok, 1 degraded, 2 critical.", registry=reg)

    def _declare_resume_metrics(self) -> None:
        """Sessions whose client dropped, held for a resume (`serve.resume`)."""
        reg = self.registry
        self._resumes = Counter(SESSION_RESUMES_TOTAL, "Resume attempts by outcome.",
                                ["outcome"], registry=reg)
        for outcome in RESUME_OUTCOMES:
            self._resumes.labels(outcome)
        self._lease_ends = Counter(SESSION_LEASES_ENDED_TOTAL, "Leases (sessions held after "
                                   "their client dropped) by how they ended.", ["outcome"],
                                   registry=reg)
        for outcome in LEASE_OUTCOMES:
            self._lease_ends.labels(outcome)
        self._leases_refused = Counter(
            SESSION_LEASES_REFUSED_TOTAL, "Dropped sessions not held for a resume: their "
            "peer's held sessions were at --max-leases-per-peer (the session ended).",
            registry=self.registry)
        self._leased = Gauge(SESSIONS_LEASED, "Sessions held for a client that dropped "
                             "(counted in the open sessions too).", registry=reg)
        self._resume_seconds = Histogram(
            SESSION_RESUME_SECONDS, "From a resume's upgrade request to its missed events "
            "queued.", buckets=LATENCY_BUCKETS_S, registry=reg)
        self._away_seconds = Histogram(SESSION_AWAY_SECONDS, "How long a resumed session's "
                                       "client was away.", buckets=AWAY_BUCKETS_S, registry=reg)

        self._checkpoints = Counter(SESSION_CHECKPOINTS_TOTAL, "Session checkpoints "
                                    "(serve.checkpointing) by outcome.", ["outcome"],
                                    registry=reg)
        for outcome in CHECKPOINT_OUTCOMES:
            self._checkpoints.labels(outcome)
        self._migrations = Counter(SESSION_MIGRATIONS_TOTAL, "Sessions a draining server "
                                   "checkpointed and told to resume elsewhere (close 4002).",
                                   registry=reg)
        self._checkpoint_bytes = Histogram(SESSION_CHECKPOINT_BYTES, "Size of a stored session "
                                           "checkpoint (engine snapshot + session state).",
                                           buckets=CHECKPOINT_BYTES_BUCKETS, registry=reg)
        self._checkpoint_seconds = Histogram(
            SESSION_CHECKPOINT_SECONDS, "Engine-thread time to snapshot one checkpoint (it "
            "delays the next step by as much; serializing runs on a worker thread).",
            buckets=LATENCY_BUCKETS_S, registry=reg)

    def observe_reply(self, gap_ms: list[float], spoken: bool) -> None:
        """A reply closed with these gaps (`serve.realtime.pacing.Playback.gap_ms`)."""
        output = "audio" if spoken else "text"
        for ms in gap_ms:
            self._reply_gaps.labels(output).inc()
            self._reply_gap_seconds.labels(output).observe(ms / 1e3)
        self._replies_with_gaps.labels(output, "yes" if gap_ms else "no").inc()

    def input_behind(self, first: bool) -> None:
        """A chunk of a session's real-time audio was kept past its buffer bound (`first`: it
        began a stretch behind)."""
        self._input_behind_chunks.inc()
        if first:
            self._input_behind_stretches.inc()

    def observe_voice_stage(self, stage: str, seconds: float) -> None:
        """One piece of a voice stage's work: `encoder` (a Whisper pass), `lm` (a reply's
        frame), `voice` (a sentence)."""
        self._voice_stage.labels(stage).observe(seconds)

    def session_migrated(self) -> None:
        """A draining server handed a session to the others (closed 4002 after its
        checkpoint was stored)."""
        self._migrations.inc()

    def checkpoint(self, outcome: str, nbytes: int | None = None,
                   seconds: float | None = None) -> None:
        self._checkpoints.labels(outcome).inc()
        if nbytes is not None:
            self._checkpoint_bytes.observe(nbytes)
        if seconds is not None:
            self._checkpoint_seconds.observe(seconds)

    def resume_attempt(self, outcome: str, away_s: float | None = None) -> None:
        """`outcome`: resumed or refused_<why>; `away_s`: a resumed client's time away."""
        self._resumes.labels(outcome).inc()
        if away_s is not None:
            self._away_seconds.observe(away_s)

    def observe_resume(self, latency_s: float) -> None:
        self._resume_seconds.observe(latency_s)

    def lease_refused(self) -> None:
        """A dropped session was not held: its peer's sessions held for a resume are full."""
        self._leases_refused.inc()

    def watch_door(self, door) -> None:
        """Export the transport's door (`serve.edge.guard.Door`), read at scrape time:
        connections per listener, half-open ones, and what it refused or evicted."""
        self.registry.register(_DoorCollector(door))

    def set_sessions_leased(self, num_sessions: int) -> None:
        self._leased.set(num_sessions)

    def lease_ended(self, outcome: str) -> None:
        self._lease_ends.labels(outcome).inc()

    def observe_frame(self, status: str, latency_s: float, num_tokens: int, good: bool) -> None:
        """Record one answered frame; `status` is a frame status value (str or StrEnum) and
        `good` is the frame's own verdict (`Frame.good`: one definition of goodput)."""
        self._frames.labels(str(status)).inc()
        self._frame_latency.observe(latency_s)
        self._frame_tokens.observe(num_tokens)
        if good:
            self._good_frames.inc()
        self._push_good(good)

    def observe_late_tokens(self, num_tokens: int) -> None:
        """Tokens the engine produced for a frame after its result had gone out."""
        self._late_tokens.inc(num_tokens)

    def _push_good(self, good: bool) -> None:
        if len(self._good_window) == self._goodput_window_frames:
            self._num_good_in_window -= self._good_window.popleft()
        self._good_window.append(good)
        self._num_good_in_window += good

    def goodput_ratio(self) -> float:
        """Good share of the last `goodput_window_frames` frames (NaN before any)."""
        if not self._good_window:
            return float("nan")
        return self._num_good_in_window / len(self._good_window)

    def observe_step(self, step_s: float, batch_frames: int) -> None:
        self._step_seconds.observe(step_s)
        self._batch_frames.observe(batch_frames)

    def set_pool(self, used_blocks: int, free_blocks: int, pinned_blocks: int) -> None:
        self._pool_blocks.labels("used").set(used_blocks)
        self._pool_blocks.labels("free").set(free_blocks)
        self._pool_blocks.labels("pinned").set(pinned_blocks)

    def set_saturation_eta(self, eta_s: float) -> None:
        """Seconds until the pool is full; `math.inf` when occupancy is flat or shrinking."""
        self._saturation_eta.set(eta_s)

    def session_bounded(self) -> None:
        self._pressure_bounded.inc()

    def set_sessions_active(self, num_sessions: int) -> None:
        self._sessions_active.set(num_sessions)

    def session_closed(self, outcome: str) -> None:
        self._sessions.labels(str(outcome)).inc()

    def admission_decision(self, decision: str) -> None:
        self._admission_decisions.labels(decision).inc()

    def set_admission_signal(self, quantile: float, latency_fraction: float | None) -> None:
        """`quantile` in (0, 1] (0.95: the p95 the default AIMD limit acts on)."""
        self._admission_signal.labels(f"{quantile:g}").set(
            math.nan if latency_fraction is None else latency_fraction)

    def set_admission_cap(self, cap_sessions: int) -> None:
        self._admission_cap.set(cap_sessions)

    def set_memory_ceiling(self, max_sessions: int | None) -> None:
        self._memory_ceiling.set(float("inf") if max_sessions is None else max_sessions)

    def set_health(self, state: Health) -> None:
        self._health.set(int(state))

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format (what /metrics serves)."""
        return generate_latest(self.registry)


class _DoorCollector:
    """The door's numbers as Prometheus families, read when scraped (the loop owns the door;
    a scrape runs on the loop too)."""

    REASONS = ("at_capacity", "peer_limit", "health_at_capacity", "resume_rate",
               "evicted_half_open")

    def __init__(self, door) -> None:
        self.door = door

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        door = self.door
        connections = GaugeMetricFamily(DOOR_CONNECTIONS, "Open TCP connections counted by "
                                        "the door, per listener.", labels=["listener"])
        connections.add_metric(["client"], door.num_open)
        connections.add_metric(["health"], door.num_health_open)
        yield connections
        yield GaugeMetricFamily(DOOR_HALF_OPEN, "Client connections that have not completed "
                                "a request's headers (evicted first at the cap).",
                                value=len(door.half_open))
        refusals = CounterMetricFamily(DOOR_REFUSALS_TOTAL.removesuffix("_total"),
                                       "Connections the door refused or evicted, by reason.",
                                       labels=["reason"])
        for reason in sorted(set(self.REASONS) | set(door.refusals)):
            refusals.add_metric([reason], door.refusals[reason])
        yield refusals
