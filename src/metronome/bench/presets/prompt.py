"""`metronome bench prompt`: a long prompt's time to answer through `metronome serve` with
the feed's large prefill chunks (`--prefill-chunk-tokens`) and with a frame's chunk (64: the
large chunks off): one server per arm (turn mode, nobody else connected), both up; each
round, in each arm in turn (`bench.steps`), a new session sends about `prompt_tokens` tokens
of Hamlet and `response.create`, timed from the send to `response.done`. Derived number: the
large chunks' median time over the small ones'.
"""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass

from metronome.bench.presets import Knobs, knob
from metronome.bench.server import Server, served_facts
from metronome.bench.steps import interleave, stats
from metronome.load.client import Connection
from metronome.results.context import RunContext
from metronome.results.report import Report, Table, derived

NAME = "prompt"
SMALL = 64  # a frame's chunk (`EngineConfig.max_chunk_tokens`)


@dataclass(frozen=True)
class Config(Knobs):
    prompt_tokens: int = knob(2048, "the prompt's length (Hamlet, about this many tokens)")
    prefill_chunk_tokens: int = knob(256, "the large-chunk arm's (the other runs 64)")
    rounds: int = knob(5, "rounds, each arm once per round (after one untimed)")
    dtype: str = knob("auto", "the bundled model's dtype")

    SMOKE = dict(prompt_tokens=200, rounds=1)


class Ask:
    """A new session (opened untimed) asks `text`: the answer is timed."""

    def __init__(self, loop, url: str, text: str) -> None:
        self.run, self.url, self.text = loop.run_until_complete, url, text

    def prepare(self) -> None:
        self.conn = self.run(Connection.open(self.url, timeout_s=30))

    def step(self) -> None:
        done = self.run(self.conn.ask(self.text))
        status = done["response"]["status_details"]
        assert status["type"] == "completed" or status["reason"] == "max_output_tokens", done
        self.run(self.conn.close())


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.corpus import play_text
    from metronome.model.weights import load_tokenizer

    tokenizer = load_tokenizer()
    text = tokenizer.decode(tokenizer.encode(play_text("hamlet")).ids[:cfg.prompt_tokens])
    size, servers, loop = len(text.encode()), {}, asyncio.new_event_loop()
    ctx.record(**served_facts("bundled", cfg.dtype))
    try:
        for chunk in (SMALL, cfg.prefill_chunk_tokens):
            servers[chunk] = Server.start([
                "--dtype", cfg.dtype, "--mode", "turn", "--admission", "off",
                "--max-response-tokens", "8", "--pool-tokens", str(4 * cfg.prompt_tokens + 4096),
                "--max-message-bytes", str(max(1 << 16, 8 * size)), "--max-queued-input-tokens",
                str(2 * size), "--max-text-chars", str(max(8192, len(text))),
                "--frame-period-s", "6", "--deadline-fraction", "10",  # 60 s to answer
                "--max-buffered-audio-s", "12", "--prefill-chunk-tokens", str(chunk),
                "--log-level", "warning"], threads=None)
        times = interleave({c: Ask(loop, s.ws_url, text) for c, s in servers.items()},
                           cfg.rounds)
    finally:
        for server in servers.values():
            server.stop()
        loop.close()
    rows = [{"prefill_chunk_tokens": c, "prompt_tokens": len(tokenizer.encode(text).ids),
             "median_s": stats(t)["median_ms"] / 1e3, "min_s": stats(t)["min_ms"] / 1e3,
             "rounds_s": [s for r in t for s in r], "server": servers[c].command}
            for c, t in times.items()]
    return REPORT.finish(ctx, {"config": asdict(cfg), "rows": rows, "derived": derived(
        f"time to answer with {cfg.prefill_chunk_tokens}-token chunks over {SMALL}-token ones "
        "(medians)", rows[1]["median_s"] / rows[0]["median_s"])})


REPORT = Report("A long prompt through the server: the feed's large prefill chunks",
                spec=".2f", tables=(Table("Send to response.done", "rows"),))
report = REPORT.markdown
