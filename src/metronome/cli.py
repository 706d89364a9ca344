"""`metronome` command line: the demo (main job for now) and benchmarks."""

from __future__ import annotations

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(
    no_args_is_help=True, help="Benchmarks (not tests): print JSON, write docs."
)
app.add_typer(bench_app, name="bench")


@app.command()
def experiment(
    name: str = typer.Argument(..., help="cliff | admission | predict | quality | all"),
    out: str = typer.Option("out/experiments", help="folder for summary.json, plots, report.md"),
    scale: str = typer.Option("smoke", help="smoke (minutes, CI) | full (docs/results/paper.md)"),
    seed: int = typer.Option(0, help="base seed; every run derives its own from it"),
) -> None:
    """Reproduce one of the paper's results (or all): writes summary.json, PNG plots and
    report.md into --out (one sub-folder each for `all`)."""
    import json

    from metronome.experiments import EXPERIMENTS, Scale, run_experiments

    names = list(EXPERIMENTS) if name == "all" else [name]
    if name != "all" and name not in EXPERIMENTS:
        raise typer.BadParameter(f"unknown experiment {name!r}; choose from "
                                 f"{', '.join(EXPERIMENTS)} or all", param_hint="NAME")
    try:
        chosen = Scale(scale)
    except ValueError:
        raise typer.BadParameter("choose smoke or full", param_hint="--scale") from None
    done = run_experiments(names, out, chosen, seed)
    typer.echo(json.dumps({n: {"out": str(folder), "elapsed_s": summary["elapsed_s"]}
                           for n, (folder, summary) in done.items()}, indent=2))


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


@app.command()
def run(
    sessions: int = typer.Option(4, min=1, help="sessions to open"),
    duration_s: float = typer.Option(20.0, min=0.1, help="length of each session"),
    ramp_s: float = typer.Option(2.0, min=0.0, help="sessions open uniformly over this ramp"),
    duration_jitter: float = typer.Option(0.0, min=0.0, max=0.99, help="duration x U(1±j)"),
    frame_period_s: float = typer.Option(1.0, help="one frame of input per period"),
    deadline_fraction: float = typer.Option(1.0, help="deadline = fraction x period"),
    tokens_per_frame: int = typer.Option(12, min=1, help="text input tokens per frame"),
    output_tokens: int = typer.Option(4, min=0, help="max output tokens per frame"),
    mode: str = typer.Option("free", help="free (every frame) | turn (every 4th frame)"),
    policy: str = typer.Option(
        "sinks_window:4:512", help="unbounded | window:W | sinks_window:S:W"
    ),
    pool_tokens: int = typer.Option(65536, min=16, help="KV pool size in tokens"),
    clock: str = typer.Option("wall", help="wall | virtual (deterministic, modelled step time)"),
    input_kind: str = typer.Option("text", "--input", help="text (Hamlet) | audio (front end)"),
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    dtype: str = typer.Option("bfloat16", help="float32 | bfloat16"),
    seed: int = typer.Option(0, help="workload seed"),
    out: str = typer.Option("out/run", help="folder for frames.csv and summary.json"),
) -> None:
    """Run a local workload of real-time sessions on the engine; print the summary."""
    import json

    from metronome.runtime.local import RunConfig, run_local

    try:
        config = RunConfig(
            sessions=sessions, duration_s=duration_s, ramp_s=ramp_s,
            duration_jitter=duration_jitter, frame_period_s=frame_period_s,
            deadline_fraction=deadline_fraction, tokens_per_frame=tokens_per_frame,
            output_tokens=output_tokens, mode=mode, policy=policy, pool_tokens=pool_tokens,
            clock=clock, input=input_kind, model=model, dtype=dtype, seed=seed, out=out,
        )
        config.profile()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    summary = run_local(config)
    typer.echo(json.dumps({k: summary[k] for k in (
        "frames", "goodput", "deadline_met_fraction", "frames_by_status", "latency_ms",
        "health", "runtime_overhead")}, indent=2, default=str))


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


@bench_app.command("runtime")
def bench_runtime(
    out: str = typer.Option("docs/results/runtime.md", help="markdown report to write"),
    json_out: str = typer.Option("docs/results/runtime.json", help="raw results to write"),
    smoke: bool = typer.Option(False, help="tiny sizes, for CI"),
) -> None:
    """Latency, goodput and runtime overhead against N, bounded vs unbounded (wall clock)."""
    from metronome.bench.runtime_bench import run as run_bench

    run_bench(out_md=out, out_json=json_out, smoke=smoke)


@bench_app.command("admission")
def bench_admission(
    out: str = typer.Option("docs/results/admission.md", help="markdown report (+ plots dir)"),
    json_out: str = typer.Option("docs/results/admission.json", help="raw results to write"),
    smoke: bool = typer.Option(False, help="short runs, for CI"),
    wall: bool = typer.Option(True, help="also run the wall-clock SmolLM2 experiment"),
) -> None:
    """AIMD admission vs the swept N*: virtual clock (bounded, unbounded) and wall clock."""
    from metronome.bench.admission_bench import run as run_bench

    run_bench(out_md=out, out_json=json_out, smoke=smoke, wall=wall)


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="address to listen on"),
    port: int = typer.Option(8000, help="port to listen on"),
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    dtype: str = typer.Option("bfloat16", help="float32 | bfloat16"),
    policy: str = typer.Option(
        "sinks_window:4:512", help="every session's KV bound: unbounded | window:W | "
        "sinks_window:S:W"
    ),
    pool_tokens: int = typer.Option(65536, help="KV pool size in tokens"),
    frame_period_s: float = typer.Option(1.0, help="audio is cut into frames of this length"),
    deadline_fraction: float = typer.Option(1.0, help="deadline = fraction x frame period"),
    output_tokens: int = typer.Option(4, help="duplex: tokens generated per frame"),
    response_tokens: int = typer.Option(16, help="turn mode: tokens of one reply"),
    mode: str = typer.Option("duplex", help="default session mode: duplex | turn"),
    admission: str = typer.Option("aimd", help="aimd | static | off"),
    admission_cap: int = typer.Option(4, help="aimd: initial cap; static: the fixed cap"),
    api_key: str = typer.Option(
        None, envvar="METRONOME_API_KEY", show_default=False,
        help="require this bearer key everywhere but /healthz (prefer the env variable)",
    ),
    max_message_bytes: int = typer.Option(1 << 20, help="largest client message"),
    max_buffered_audio_s: float = typer.Option(4.0, help="unanswered audio a session may send"),
    idle_timeout_s: float = typer.Option(60.0, help="close a session silent this long"),
    max_session_s: float = typer.Option(3600.0, help="close a session this old"),
    log_level: str = typer.Option("info", help="uvicorn log level"),
) -> None:
    """Serve the OpenAI Realtime subset over WebSocket (FastAPI + uvicorn)."""
    from pydantic import ValidationError

    from metronome.serve.config import ServerConfig
    from metronome.serve.server import serve_forever

    try:
        config = ServerConfig(
            host=host, port=port, model=model, dtype=dtype, policy=policy,
            pool_tokens=pool_tokens, frame_period_s=frame_period_s,
            deadline_fraction=deadline_fraction, output_tokens_per_frame=output_tokens,
            response_tokens=response_tokens, mode=mode, admission=admission,
            admission_cap=admission_cap, api_key=api_key, max_message_bytes=max_message_bytes,
            max_buffered_audio_s=max_buffered_audio_s, idle_timeout_s=idle_timeout_s,
            max_session_s=max_session_s,
        )
    except ValidationError as err:
        raise typer.BadParameter(str(err)) from None
    serve_forever(config, log_level)


@app.command()
def load(
    url: str = typer.Option("ws://127.0.0.1:8000/v1/realtime", help="the server's realtime URL"),
    sessions: int = typer.Option(4, min=1, help="sessions to open"),
    ramp_s: float = typer.Option(2.0, min=0.0, help="sessions start over this many seconds"),
    arrival: str = typer.Option("ramp", help="ramp (evenly) | poisson (rate sessions/ramp)"),
    duration_s: float = typer.Option(30.0, min=0.1, help="speech each session streams"),
    chunk_ms: float = typer.Option(100.0, min=1.0, help="audio per append message"),
    sample_rate_hz: int = typer.Option(24000, help="input audio rate (audio/pcm)"),
    mode: str = typer.Option("duplex", help="duplex | turn"),
    audio_dir: str = typer.Option("tests/fixtures/audio", help="folder of speech WAVs"),
    api_key: str = typer.Option(None, envvar="METRONOME_API_KEY", show_default=False,
                                help="bearer key (prefer the env variable)"),
    out: str = typer.Option("out/load", help="folder for frames.csv and summary.json"),
    seed: int = typer.Option(0, help="arrival seed (poisson)"),
) -> None:
    """Open N Realtime sessions against a server, stream speech in real time, measure."""
    import asyncio
    import json

    from metronome.load.run import LoadConfig, run_load

    try:
        config = LoadConfig(url=url, sessions=sessions, ramp_s=ramp_s, arrival=arrival,
                            duration_s=duration_s, chunk_ms=chunk_ms,
                            sample_rate_hz=sample_rate_hz, mode=mode, audio_dir=audio_dir,
                            api_key=api_key, out=out, seed=seed)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    summary = asyncio.run(run_load(config))
    typer.echo(json.dumps({k: summary[k] for k in (
        "sessions", "frames", "goodput_server", "goodput_client", "latency_ms", "gap_ms",
        "errors")}, indent=2, default=str))


def main() -> None:
    app()
