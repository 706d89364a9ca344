"""A voice stage runs work with a deadline earliest first, and never runs cancelled work; the
speak stage so serves a reply about to run dry (or not begun) before one far ahead.

A real `Stage` (its thread, its executor) held busy by a first piece of work until the
test has queued the rest, so the order it then picks is the stage's, not the arrival's.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from metronome.observe.metrics import Metrics
from metronome.serve.realtime.reply import Reply
from metronome.serve.voice.speaking import Speaking
from metronome.serve.voice.stage import Stage


class Voice:
    """Speaks `text` as one sample per character, and notes what it spoke, in order."""

    def __init__(self) -> None:
        self.spoken: list[str] = []

    def speak(self, text: str, to_rate_hz: int) -> bytes:
        self.spoken.append(text)
        return bytes(2 * len(text))


async def _held_stage(voice: Voice) -> tuple[Stage[Voice], threading.Event]:
    """A stage whose thread is busy until the returned event is set."""
    stage: Stage[Voice] = Stage("test-speak", "voice", asyncio.get_running_loop(), Metrics(),
                                lambda: voice)
    gate = threading.Event()
    stage.run(gate.wait)
    return stage, gate


def test_work_with_deadlines_runs_earliest_first_and_cancelled_work_never_runs():
    async def main() -> list[str]:
        voice = Voice()
        stage, gate = await _held_stage(voice)
        futures = {name: stage.run_model(lambda v, n=name: v.speak(n, 0), due_s)
                   for name, due_s in [("c", 3.0), ("a", 1.0), ("x", 0.5), ("b", 2.0),
                                       ("b2", 2.0)]}
        futures["x"].cancel()
        assert stage.queued_due == 5
        gate.set()
        await asyncio.gather(*(f for n, f in futures.items() if n != "x"))
        assert [f.result() for n, f in futures.items() if n != "x"] == [
            bytes(2), bytes(2), bytes(2), bytes(4)]
        stage.close()
        return voice.spoken

    assert asyncio.run(main()) == ["a", "b", "b2", "c"]  # by deadline, ties in call order


def test_work_that_raises_fails_its_future_and_the_stage_goes_on():
    async def main() -> None:
        voice = Voice()
        stage, gate = await _held_stage(voice)

        def fail(v: Voice) -> bytes:
            raise ValueError("bad sentence")

        failing = stage.run_model(fail, 1.0)
        after = stage.run_model(lambda v: v.speak("ok", 0), 2.0)
        gate.set()
        try:
            await failing
        except ValueError as err:
            assert "bad sentence" in str(err)
        else:
            raise AssertionError("the failure was not told")
        assert await after == bytes(4)
        stage.close()

    asyncio.run(main())


class Owner:
    """A reply's owner with a clock the test sets."""

    def __init__(self) -> None:
        self.now = 100.0
        self.events: list = []
        self.conversation = SimpleNamespace(add=lambda item: None)

    def now_s(self) -> float:
        return self.now

    def emit(self, event) -> None:
        self.events.append(event)


@pytest.mark.parametrize("by_deadline", [True, False])
def test_a_reply_with_seconds_buffered_yields_the_speaker_to_a_neighbours_first_sentence(
        by_deadline):
    """Reply A has sent 10 s of audio and queues three more sentences; reply B (its frame
    arrived now) then queues its first. A's listener has 10 s left, so B's sentence is
    spoken first of all (in call order it would wait for all of A's), and A's sentences keep
    their order. `--speak-order arrival` (`by_deadline` False) speaks in call order, as
    before."""

    async def main() -> list[str]:
        voice = Voice()
        stage, gate = await _held_stage(voice)
        owner = Owner()
        a = Reply(owner, "resp_a", "item_a", None)  # type: ignore[arg-type]
        a.voice = Speaking(stage, 24000, a, by_deadline)
        a.playback.add(owner.now - 1.0, 11.0)  # 10 s still to play
        b = Reply(owner, "resp_b", "item_b", None)  # type: ignore[arg-type]
        b.voice = Speaking(stage, 24000, b, by_deadline)
        b.frame = SimpleNamespace(arrival_s=owner.now)  # type: ignore[assignment]
        a.voice.push("A one is here. A two is here. A three is here. ")
        b.voice.push("B one is here. ")
        owner.now += 0.2
        gate.set()
        while len(voice.spoken) < 4:
            await asyncio.sleep(0.01)
        stage.close()
        return voice.spoken

    a_sentences = ["A one is here.", "A two is here.", "A three is here."]
    assert asyncio.run(main()) == (["B one is here.", *a_sentences] if by_deadline
                                   else [*a_sentences, "B one is here."])


def test_a_cancelled_voice_drops_its_queued_sentences_unspoken():
    async def main() -> tuple[list[str], list[bool]]:
        voice = Voice()
        stage, gate = await _held_stage(voice)
        owner = Owner()
        done: list[bool] = []

        class Told(Reply):
            def on_voice_done(self) -> None:
                done.append(True)

        a = Told(owner, "resp_a", "item_a", None)  # type: ignore[arg-type]
        a.voice = Speaking(stage, 24000, a)
        a.voice.push("One is here. Two is here. Three is here. ")
        a.voice.finish()
        a.voice.cancel()
        after = stage.run_model(lambda v: v.speak("next", 0), 0.0)
        gate.set()
        await after
        await asyncio.sleep(0.05)
        stage.close()
        return voice.spoken, done

    spoken, done = asyncio.run(main())
    assert spoken == ["next"] and done == [True]
