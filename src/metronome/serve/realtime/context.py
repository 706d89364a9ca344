"""What the model sees of a session, and how: its settings (mode, input rate, turn detection,
voice, transcription: `serve.realtime.settings`), its KV bound (`session.truncation` within
the server's ceilings, its pinned instructions: `serve.realtime.bound`) and its instructions.

A `session.update` is checked whole before anything changes (`plan`: the settings, the
bound chosen, the instructions' pin), then applied by the session. Instructions are a
system message at their point of the conversation: pinned when they are its first input
(the bound's sinks are their tokens), else re-pinned: the engine rewrites the pinned prefix
with them once the window has left the old one (`Beat.repin`, told back as a `pinned`
rebound), and meanwhile they are in the window.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from metronome.engine.types import EngineFeature, Rebound
from metronome.runtime.ports import Answer
from metronome.serve import protocol as p
from metronome.serve.config import ServerConfig
from metronome.serve.realtime import bound as bounds
from metronome.serve.realtime.bound import BoundLimits, SessionBound
from metronome.serve.realtime.chat import ChatText
from metronome.serve.realtime.intake import Intake
from metronome.serve.realtime.settings import SessionSettings

log = logging.getLogger(__name__)
MAX_BYTES_PER_TOKEN = 16  # instructions longer than this many bytes per pinned token allowed
# cannot be pinned in any real text: refused before they are tokenized


@dataclass(frozen=True)
class ContextUpdate:
    """A `session.update`, checked: what the session becomes."""

    settings: SessionSettings
    bound: SessionBound
    instructions: str | None  # new instructions (None: unchanged)
    instruction_ids: list[int] | None  # their tokens (None: none, or no tokenizer)
    not_honored: list[str]  # fields accepted and not acted on


class Context:
    def __init__(self, session_id: str, intake: Intake, limits: BoundLimits,
                 chat: ChatText | None, settings: SessionSettings) -> None:
        self.session_id = session_id
        self.intake = intake  # the model's input goes in there (its stream and beat)
        self.limits = limits  # what a session's bound may be
        self.chat = chat  # None: the model has no tokenizer (presets): audio only
        self.settings = settings
        self.bound = SessionBound()  # its session.truncation and pinned prefix
        self.instructions: str | None = None
        self.told_not_honored: set[str] = set()  # logged once per session

    def plan(self, update: p.SessionIn, config: ServerConfig, speaks: bool,
             hears: bool) -> ContextUpdate:
        """`update` checked whole against what the server serves (`ClientError`, nothing
        changed): the settings, the bound chosen, the instructions and their pin."""
        limits, started = self.limits, self.intake.started
        settings = self.settings.updated(update, config, self.chat is not None, speaks, hears)
        instructions = update.instructions
        if instructions == self.instructions:
            instructions = None
        bound = self.bound
        if "truncation" in update.model_fields_set and update.truncation is not None:
            bound = bounds.choose(update.truncation, bound, limits, started)
        instruction_ids = None
        if instructions is not None:
            self.intake.check_text(instructions, "session.instructions")
            if self.chat is not None:
                instruction_ids = self._instruction_ids(self.chat, instructions)
                if not started and limits.per_session:  # its first input: pinned
                    bound = bounds.pinned(bound, len(instruction_ids), limits)
        not_honored = update.not_honored(speaks, hears)
        if instructions is not None and instruction_ids is None:
            not_honored.append("instructions (the model has no tokenizer)")
        return ContextUpdate(settings, bound, instructions, instruction_ids, not_honored)

    def _instruction_ids(self, chat: ChatText, instructions: str) -> list[int]:
        """The instructions' tokens as a system message, within the pinned-prefix ceiling.
        Tokenized on the loop (instructions change rarely; ~0.3 us a byte) only when they can
        be that short: a text of more than `MAX_BYTES_PER_TOKEN` bytes a token allowed is
        refused unread."""
        limits = self.limits
        upper = chat.max_item_tokens("system", instructions)
        if upper > limits.max_pinned_tokens * MAX_BYTES_PER_TOKEN:
            bounds.check_instructions(upper // MAX_BYTES_PER_TOKEN, limits)
        ids = chat.item_ids("system", instructions)
        if limits.per_session:
            bounds.check_instructions(len(ids), limits)
        return ids

    def set_bound(self, bound: SessionBound) -> None:
        """Serve the session under `bound` from now on (the engine applies it in order,
        before any input queued after this)."""
        limits, intake = self.limits, self.intake
        policy = bound.policy(limits)
        self.bound = bound
        if limits.per_session and policy != intake.stream.policy:
            intake.beat.set_policy(intake.stream, policy)

    def instruct(self, instructions: str, ids: list[int]) -> None:
        """Instructions are a system message at this point of the conversation (a frame);
        re-pinned if the session's input had started (see the module docstring)."""
        intake = self.intake
        started = intake.started
        intake.queue_ids("system", ids, "session.instructions")
        self.instructions = instructions
        beat, stream = intake.beat, intake.stream
        if started and beat.serves(EngineFeature.REPIN) and stream.policy.bounded:
            sid = self.session_id
            beat.repin(stream, ids).add_done_callback(
                lambda done: _log_repin_failure(sid, done))

    def on_rebound(self, rebound: Rebound) -> None:
        """The engine changed the session's bound: a re-pin's sinks are the bound's pin from
        now on (scored at rolling positions); past the position limit, a later choice keeps
        rolling positions."""
        if rebound.reason == "pinned":
            self.set_bound(bounds.pinned(self.bound, rebound.policy.sink_tokens, self.limits))
        elif rebound.reason == "position_limit":
            self.bound = replace(self.bound, rolled=True)

    def tell_not_honored(self, fields: list[str]) -> None:
        new = [name for name in fields if name not in self.told_not_honored]
        if new:
            log.info("session %s: accepted and not acted on (the served model cannot): %s",
                     self.session_id, ", ".join(new))
            self.told_not_honored.update(new)

    # ---- a checkpoint ------------------------------------------------------------------------
    def saved(self) -> dict:
        return {"settings": self.settings.saved(), "instructions": self.instructions,
                "bound_choice": self.bound.saved(),
                "told_not_honored": sorted(self.told_not_honored)}

    def load(self, saved: dict) -> None:
        """`saved()`'s state (the settings are the session's from its start)."""
        self.instructions = saved["instructions"]
        self.bound = SessionBound.load(saved.get("bound_choice"))  # older: auto
        self.told_not_honored = set(saved["told_not_honored"])


def _log_repin_failure(session_id: str, done: Answer[bool]) -> None:
    if not done.cancelled() and done.exception() is not None:
        log.error("session %s: re-pinning its instructions failed: %s", session_id,
                  done.exception())
