"""`metronome demo`: a short local run of the engine on the bundled model (the main job is
`metronome serve`).

A few sessions stream text frames (each frame: a line of input, then a short reply);
all due work is batched into shared engine steps, and the KV pool is shown after each
frame, so the bound is visible: bounded sessions plateau while the conversation goes on.
"""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.dtypes import resolve_dtype
from metronome.model.weights import load_model, load_tokenizer
from metronome.stream import Stream
from metronome.workload_defaults import DEMO_POOL_TOKENS

FRAMES = [
    "User: Hi! Can you tell me a fact about the ocean?\nAssistant:",
    "User: Interesting. And one about the moon?\nAssistant:",
    "User: Which is bigger, the Earth or the Moon?\nAssistant:",
    "User: Name a famous playwright.\nAssistant:",
    "User: What is the capital of Italy?\nAssistant:",
    "User: Thanks, and goodbye!\nAssistant:",
]



def run_demo(model: str, num_sessions: int, num_frames: int, policy: str, dtype: str) -> None:
    console = Console()
    try:
        torch_dtype = resolve_dtype(dtype)
    except ValueError as err:
        raise SystemExit(f"--dtype: {err}") from None
    residency = ResidencyPolicy.parse(policy)
    with console.status("loading model"):
        llm = load_model(model, torch_dtype)
        tokenizer = load_tokenizer(model)
    engine = Engine(llm, EngineConfig(pool_tokens=DEMO_POOL_TOKENS))
    console.print(
        f"model [bold]{llm.config.name}[/] ({dtype}), {num_sessions} sessions, policy "
        f"[bold]{residency}[/], pool {engine.pool.num_blocks} blocks x {engine.config.block_size}"
    )
    session_ids = [engine.open_session(Stream(f"demo-{i}", spec=SessionSpec(policy=residency)))
                   for i in range(num_sessions)]
    for frame in range(num_frames):
        replies = {sid: [] for sid in session_ids}
        for i, sid in enumerate(session_ids):
            text = FRAMES[(frame + i) % len(FRAMES)]
            ids = tokenizer.encode(text).ids if tokenizer else [1 + frame + i] * 8
            engine.submit(sid, ids, max_new_tokens=12)
        started_s, steps = time.perf_counter(), 0
        while engine.has_work:
            for sid, new_ids in engine.step().new_token_ids.items():
                replies[sid] += new_ids
            steps += 1
        elapsed_ms = (time.perf_counter() - started_s) * 1e3
        _show_frame(console, engine, frame, replies, tokenizer, steps, elapsed_ms)
    for sid in session_ids:
        engine.close(sid)
    stats = engine.pool_stats()
    console.print(f"all sessions closed: {stats.used_blocks} blocks in use (expected 0)")


def _show_frame(console, engine, frame, replies, tokenizer, steps, elapsed_ms) -> None:
    table = Table(title=f"frame {frame}: {steps} batched steps, {elapsed_ms:.0f} ms")
    for column in ("session", "reply", "tokens", "resident KV tokens", "blocks"):
        table.add_column(column)
    for sid, tokens in replies.items():
        text = tokenizer.decode(tokens) if tokenizer else str(tokens)
        table.add_row(
            str(sid), text.strip().replace("\n", " ")[:60], str(engine.session_tokens(sid)),
            str(engine.resident_tokens(sid)), str(engine.session_blocks(sid)),
        )
    console.print(table)
    stats = engine.pool_stats()
    console.print(
        f"pool: {stats.used_blocks} used / {stats.free_blocks} free / {stats.pinned_blocks} pinned"
    )
