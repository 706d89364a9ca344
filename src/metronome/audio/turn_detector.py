"""Turn detection rules: a speech probability per chunk -> where speech starts and stops.

Pure and clock-free: positions are milliseconds of the audio stream, given with each chunk.

    probability >= threshold            speech: it starts at this chunk's start (if it had not)
                                        and, so far, ends at this chunk's end
    stop_threshold <= p < threshold     undecided: neither extends speech nor ends it
    p < stop_threshold, while speaking  silence: once `silence_duration_ms` have passed since
                                        speech last ended, it stops there (at that end);
                                        once `pause_ms` have (if given, and shorter), it
                                        paused there: told once per silence, the turn may
                                        still go on (a pass can hear the turn ahead of its end)

The gap between the two thresholds is Silero's hysteresis (0.15 below the threshold, here
at most half the threshold, so that a low threshold still has a silence below it): a
probability wavering just under the threshold in the middle of a word does not end a turn.
A stop is reported where speech ended, not where the silence was confirmed.

A turn has a limit (`max_turn_ms`, if given): speech that has gone on that long without a
stop stops there (`SpeechStopped.at_limit`: the turn is committed and answered, as
OpenAI's server VAD would at a silence), and, if it goes on, starts again at once
(`SpeechStarted.continues`: speech already under way, which does not barge in on the
answer). A room with a television gets answers, not one endless turn.
"""

from __future__ import annotations

from dataclasses import dataclass

STOP_MARGIN = 0.15  # Silero's: the stop threshold sits this far below the start threshold


@dataclass(frozen=True)
class SpeechStarted:
    start_ms: float
    continues: bool = False  # speech that went on past the turn limit: a new turn of it


@dataclass(frozen=True)
class SpeechStopped:
    start_ms: float
    end_ms: float
    at_limit: bool = False  # stopped by the turn limit, speech still under way
    continued: bool = False  # the turn began as speech that went on past the limit


@dataclass(frozen=True)
class SpeechPaused:
    """`pause_ms` of silence since speech last ended at `end_ms`: the turn may end there."""

    start_ms: float
    end_ms: float


TurnEvent = SpeechStarted | SpeechPaused | SpeechStopped


class TurnDetector:
    def __init__(self, threshold: float, silence_duration_ms: float,
                 pause_ms: float | None = None, max_turn_ms: float | None = None) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        if silence_duration_ms < 0:
            raise ValueError(f"silence_duration_ms must be >= 0, got {silence_duration_ms}")
        if max_turn_ms is not None and max_turn_ms <= 0:
            raise ValueError(f"max_turn_ms must be > 0, got {max_turn_ms}")
        self.max_turn_ms = max_turn_ms
        self._continues = False  # the speech under way went on past the turn limit
        self.threshold = threshold
        self.stop_threshold = threshold - min(STOP_MARGIN, threshold / 2)
        self.silence_duration_ms = silence_duration_ms
        # a pause is told only if it comes before the stop
        self.pause_ms = pause_ms if pause_ms is not None and pause_ms < silence_duration_ms \
            else None
        self._pause_told = False  # this silence's pause was told
        self.speech_start_ms: float | None = None  # None: not speaking
        self._speech_end_ms = 0.0  # end of the last chunk judged speech

    @property
    def speaking(self) -> bool:
        return self.speech_start_ms is not None

    def push(self, probability: float, start_ms: float, end_ms: float) -> TurnEvent | None:
        """One chunk's P(speech), covering [start_ms, end_ms) of the stream."""
        assert start_ms < end_ms and start_ms >= self._speech_end_ms, (start_ms, end_ms)
        if probability >= self.threshold:
            self._speech_end_ms = end_ms
            self._pause_told = False
            if self.speech_start_ms is None:
                self.speech_start_ms = start_ms
                return SpeechStarted(start_ms, self._continues)
            if self.max_turn_ms is not None and end_ms - self.speech_start_ms >= self.max_turn_ms:
                stopped = SpeechStopped(self.speech_start_ms, end_ms, True, self._continues)
                self.speech_start_ms, self._continues = None, True
                return stopped
            return None
        if self.speech_start_ms is None:
            self._continues = False  # a chunk without speech: what follows is a new turn
            return None
        if probability >= self.stop_threshold:
            return None
        silent_ms = end_ms - self._speech_end_ms
        if silent_ms < self.silence_duration_ms:
            if (self.pause_ms is None or self._pause_told or silent_ms < self.pause_ms):
                return None
            self._pause_told = True
            return SpeechPaused(self.speech_start_ms, self._speech_end_ms)
        stopped = SpeechStopped(self.speech_start_ms, self._speech_end_ms,
                                continued=self._continues)
        self.speech_start_ms, self._continues = None, False
        return stopped
