"""`metronome` command line: the demo (main job for now) and benchmarks."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(
    no_args_is_help=True, help="Benchmarks (not tests): print JSON, write docs."
)
app.add_typer(bench_app, name="bench")


@app.command()
def demo(
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    sessions: int = typer.Option(4, min=1, help="concurrent sessions"),
    frames: int = typer.Option(6, min=1, help="text frames streamed into each session"),
    policy: str = typer.Option("sinks_window:4:64", help="unbounded | window:W | sinks_window:S:W"),
    dtype: str = typer.Option("bfloat16", help="float32 | bfloat16"),
) -> None:
    """Stream text frames into a few bounded sessions on the bundled model and show the pool."""
    from metronome.demo import run_demo

    run_demo(model=model, num_sessions=sessions, num_frames=frames, policy=policy, dtype=dtype)


@bench_app.command("engine")
def bench_engine(
    out: str = typer.Option("docs/results/engine.md", help="markdown report to write"),
    json_out: str = typer.Option("docs/results/engine.json", help="raw results to write"),
    smoke: bool = typer.Option(False, help="tiny sizes, for CI"),
    repeats: int = typer.Option(5, min=1, help="timed steps per configuration"),
) -> None:
    """Step latency, tokens/s and resident KV: unbounded vs sinks+window vs transformers."""
    from metronome.bench.engine_bench import run

    run(out_md=out, out_json=json_out, smoke=smoke, repeats=repeats)


def main() -> None:
    app()
