"""`metronome bench prompt`: a long prompt's time to answer through the server, with the
feed's large prefill chunks (`--prefill-chunk-tokens`, 256 by default) and without (64: a
frame's chunk, as before), side by side.

One `ServerThread` per arm (the bundled model, turn mode, nobody else connected: the feed's
*alone* case, `runtime.feed`). Each round, in each arm, a new session sends one text item of
about `prompt_tokens` tokens of Hamlet and `response.create`; the time from the send to
`response.done` (the whole prompt prefilled, `response_tokens` generated). The arms
alternate within a round, so drift on this shared machine hits both; min and median over
rounds. What the large chunks cost a real-time session that speaks up meanwhile is checked
on the virtual clock (`tests/runtime/test_beat_feed.py`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field

from metronome.engine.engine import EngineConfig
from metronome.results.context import RunContext
from metronome.results.provenance import describe
from metronome.results.tables import fmt, md_table

NAME = "prompt"
BEFORE = EngineConfig.max_chunk_tokens  # a frame's chunk: the large chunks off


@dataclass(frozen=True)
class Config:
    prompt_tokens: int = field(default=2048, metadata={"help": "the prompt's length (Hamlet "
                                                              "text, about this many tokens)"})
    prefill_chunk_tokens: int = field(default=EngineConfig.max_prefill_chunk_tokens, metadata={
        "help": "the arm with large chunks (the other runs 64, a frame's chunk)"})
    rounds: int = field(default=5, metadata={"help": "rounds, each arm once per round"})
    dtype: str = field(default="auto", metadata={"help": "the bundled model's dtype"})

    @classmethod
    def smoke(cls) -> Config:
        return cls(prompt_tokens=200, rounds=1)


def _prompt(tokenizer, tokens: int) -> str:
    from metronome.corpus import play_text

    ids = tokenizer.encode(play_text("hamlet")).ids[:tokens]
    return tokenizer.decode(ids)


def _answer_s(ws_url: str, text: str) -> float:
    """A new session asks `text`: seconds from the send to `response.done`."""
    from websockets.sync.client import connect

    with connect(ws_url, max_size=None) as ws:
        json.loads(ws.recv(timeout=30))  # session.created
        started = time.perf_counter()
        ws.send(json.dumps({"type": "conversation.item.create", "item": {
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": text}]}}))
        ws.send(json.dumps({"type": "response.create"}))
        while True:
            event = json.loads(ws.recv(timeout=600))
            if event["type"] == "response.done":
                assert event["response"]["status"] == "completed", event
                return time.perf_counter() - started
            assert event["type"] != "error", event


def run(ctx: RunContext, cfg: Config) -> dict:
    from metronome.model.dtypes import resolve_dtype
    from metronome.model.weights import load_model, load_tokenizer
    from metronome.serve.config import ServerConfig
    from metronome.serve.server import ServerThread

    if cfg.prefill_chunk_tokens <= BEFORE:
        raise ValueError(f"--prefill-chunk-tokens must exceed {BEFORE} (the arm it is "
                         f"compared with), got {cfg.prefill_chunk_tokens}")
    dtype = resolve_dtype(cfg.dtype)
    model, tokenizer = load_model("bundled", dtype), load_tokenizer()
    ctx.record(model="bundled (SmolLM2-135M-Instruct)", dtype=str(dtype).removeprefix("torch."))
    text = _prompt(tokenizer, cfg.prompt_tokens)
    arms = {chunk: ServerConfig(mode="turn", admission="off", response_tokens=8,
                                pool_tokens=4 * cfg.prompt_tokens + 4096,
                                max_message_bytes=max(1 << 16, 8 * len(text)),
                                max_queued_input_tokens=2 * len(text.encode()),
                                max_text_chars=max(8192, len(text)),
                                frame_period_s=6.0, deadline_fraction=10.0,  # 60 s to answer
                                max_buffered_audio_s=12.0,
                                prefill_chunk_tokens=chunk)
            for chunk in (BEFORE, cfg.prefill_chunk_tokens)}
    seconds: dict[int, list[float]] = {chunk: [] for chunk in arms}
    servers = {chunk: ServerThread(config, model, tokenizer) for chunk, config in arms.items()}
    for server in servers.values():
        server.__enter__()
    try:
        from metronome.serve.protocol import with_extensions

        for server in servers.values():  # warm-up: kernels, first-call costs
            _answer_s(with_extensions(server.ws_url), text[:200])
        for k in range(cfg.rounds):
            order = list(servers) if k % 2 == 0 else list(reversed(servers))
            for chunk in order:
                seconds[chunk].append(_answer_s(with_extensions(servers[chunk].ws_url), text))
            ctx.log(f"round {k + 1}/{cfg.rounds}: " + ", ".join(
                f"chunk {c}: {seconds[c][-1]:.2f} s" for c in seconds))
    finally:
        for server in servers.values():
            server.__exit__(None, None, None)
    rows = [{"prefill_chunk_tokens": chunk, "min_s": min(s), "median_s": statistics.median(s),
             "samples_s": s} for chunk, s in seconds.items()]
    result = {"prompt_tokens": len(tokenizer.encode(text).ids), "rounds": cfg.rounds,
              "dtype": str(dtype).removeprefix("torch."), "rows": rows,
              "median_ratio": rows[1]["median_s"] / rows[0]["median_s"],
              "min_ratio": rows[1]["min_s"] / rows[0]["min_s"]}
    plot(ctx, result)
    return result


def plot(ctx: RunContext, r: dict) -> None:
    plt, save = ctx.figure(ctx.out_json.stem + ".png")  # beside its report (--out)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, row in enumerate(r["rows"]):
        ax.scatter([i] * len(row["samples_s"]), row["samples_s"], alpha=0.6)
        ax.bar(i, row["median_s"], alpha=0.3)
    ax.set_xticks(range(len(r["rows"])),
                  [f"chunk {row['prefill_chunk_tokens']}" for row in r["rows"]])
    ax.set_ylabel("send -> response.done (s)")
    ax.set_title(f"a {r['prompt_tokens']}-token prompt through the server")
    save(fig)


def report(r: dict) -> str:
    table = md_table(["largest prefill chunk (tokens)", "min s", "median s", "samples s"],
                     [(row["prefill_chunk_tokens"], fmt(row["min_s"], ".2f"),
                       fmt(row["median_s"], ".2f"), ", ".join(f"{s:.2f}" for s in row["samples_s"]))
                      for row in r["rows"]])
    return (f"# A long prompt through the server: the feed's large prefill chunks\n\n"
            f"{describe(r['provenance'])}\n\nCommand: `{r['command']}`, "
            f"{r['elapsed_s']:.0f} s. Written by the command; do not edit by hand.\n\n"
            f"One session at a time (nobody else live), a {r['prompt_tokens']}-token prompt "
            f"(Hamlet) and `response.create`, {r['rounds']} rounds alternating the arms; "
            f"dtype {r['dtype']}.\n\n{table}\n\n"
            f"Large chunks over a frame's chunk: median {r['median_ratio']:.2f}x, min "
            f"{r['min_ratio']:.2f}x the time.\n")
