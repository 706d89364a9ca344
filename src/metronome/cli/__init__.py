"""`metronome`: serve real-time sessions (the main job: `metronome serve`), load-test a
server, run local workloads, reproduce the paper's experiments, and benchmark."""

from __future__ import annotations

import json

import typer

from metronome import workload_defaults as defaults
from metronome.cli.bench import bench_app
from metronome.cli.experiment import experiment
from metronome.cli.serve import cluster_app, serve

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
app.command()(serve)
app.command()(experiment)
app.add_typer(bench_app, name="bench")
app.add_typer(cluster_app, name="cluster")
POLICY_HELP = "unbounded | window:W | sinks_window:S:W, optionally @rolling"
DTYPE_HELP = "auto (bfloat16 where the CPU has native bf16, else float32) | float32 | bfloat16"


@app.command()
def demo(
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    sessions: int = typer.Option(4, min=1, help="concurrent sessions"),
    frames: int = typer.Option(6, min=1, help="text frames streamed into each session"),
    policy: str = typer.Option(defaults.DEMO_POLICY_SPEC, help=POLICY_HELP),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
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
    frame_period_s: float = typer.Option(defaults.FRAME_PERIOD_S,
                                         help="one frame of input per period"),
    deadline_fraction: float = typer.Option(defaults.DEADLINE_FRACTION,
                                            help="deadline = fraction x period"),
    tokens_per_frame: int = typer.Option(defaults.INPUT_TOKENS_PER_FRAME, min=1,
                                         help="text input tokens per frame"),
    output_tokens: int = typer.Option(defaults.OUTPUT_TOKENS_PER_FRAME, min=0,
                                      help="max output tokens per frame"),
    mode: str = typer.Option("duplex", help="duplex (output every frame) | turn (every 4th)"),
    policy: str = typer.Option(defaults.POLICY_SPEC, help=POLICY_HELP),
    pool_tokens: int = typer.Option(defaults.POOL_TOKENS, min=16, help="KV pool size in tokens"),
    clock: str = typer.Option("wall", help="wall | virtual (deterministic, modelled step time)"),
    input_kind: str = typer.Option("text", "--input", help="text (Hamlet) | audio (front end)"),
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    engine: str = typer.Option("native", help="native | vllm (vLLM + the sinks+window plugin, "
                               "`make vllm-install`; wall clock, text input)"),
    vllm_mode: str = typer.Option("default", help="--engine vllm: default (vLLM's own: "
                                  "compiled) | eager (enforce_eager: starts ~4x faster)"),
    dtype: str = typer.Option("auto", help=DTYPE_HELP),
    engine_path: str = typer.Option("fast", help="native engine: fast (paged kernel, prepacked "
                                    "projections) | reference (dense attention, F.linear)"),
    seed: int = typer.Option(0, help="workload seed"),
    out: str = typer.Option("out/run", help="folder for frames.csv and summary.json"),
) -> None:
    """Run a local workload of real-time sessions on the engine; print the summary."""
    from metronome.sim.local import RunConfig, run_local

    try:
        config = RunConfig(
            sessions=sessions, duration_s=duration_s, ramp_s=ramp_s,
            duration_jitter=duration_jitter, frame_period_s=frame_period_s,
            deadline_fraction=deadline_fraction, tokens_per_frame=tokens_per_frame,
            output_tokens=output_tokens, mode=mode, policy=policy, pool_tokens=pool_tokens,
            clock=clock, input=input_kind, model=model, engine=engine, vllm_mode=vllm_mode,
            dtype=dtype, seed=seed,
            out=out, engine_path=engine_path,
        )
        config.profile()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    if config.clock == "wall":  # before the model loads: runtime.cores says why
        from metronome.runtime.cores import reserve_for_engine_thread, shorten_gil_switch

        if config.engine == "native":
            reserve_for_engine_thread()
        else:  # vLLM binds its own threads: the GIL switch only
            shorten_gil_switch()
    summary = run_local(config)
    typer.echo(json.dumps({k: summary[k] for k in (
        "frames", "goodput", "deadline_met_fraction", "frames_by_status", "latency_ms",
        "health", "runtime_overhead")}, indent=2, default=str))


@app.command()
def plan(
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    dtype: str = typer.Option("bfloat16", help="KV and weights dtype on the target"),
    pool_tokens: int = typer.Option(None, min=1, help="KV budget in tokens", show_default=False),
    pool_bytes: str = typer.Option(None, help="KV budget in bytes (e.g. 12GiB)",
                                   show_default=False),
    gpu_memory: str = typer.Option(None, help="KV budget from a GPU's memory (e.g. 80GB): "
                                   "x --utilization - weights - --reserve", show_default=False),
    utilization: float = typer.Option(0.9, help="share of --gpu-memory the engine may use"),
    weights_bytes: str = typer.Option(None, help="weights (default: counted from the shapes)",
                                      show_default=False),
    reserve: str = typer.Option("0", help="--gpu-memory kept for activations (e.g. 4GB)"),
    policy: str = typer.Option(defaults.POLICY_SPEC, help=POLICY_HELP),
    block_size: int = typer.Option(defaults.BLOCK_SIZE_TOKENS, min=1,
                                   help="KV block size in tokens"),
    frame_period_s: float = typer.Option(defaults.FRAME_PERIOD_S, help="one frame per period"),
    deadline_fraction: float = typer.Option(defaults.DEADLINE_FRACTION,
                                            help="deadline = fraction x period"),
    tokens_in: int = typer.Option(defaults.INPUT_TOKENS_PER_FRAME, min=0,
                                  help="input tokens per frame"),
    tokens_out: int = typer.Option(defaults.OUTPUT_TOKENS_PER_FRAME, min=0,
                                   help="output tokens per frame"),
    session_s: float = typer.Option(3600.0, help="session length"),
    step_cost: str = typer.Option(None, help="step cost model JSON (default: the packaged "
                                  "calibration)", show_default=False),
    fixed_s: float = typer.Option(None, help="step cost: fixed s per step", show_default=False),
    per_token_s: float = typer.Option(None, help="step cost: s per input token",
                                      show_default=False),
    per_context_token_s: float = typer.Option(None, help="step cost: s per attended key",
                                              show_default=False),
    target_fraction: float = typer.Option(defaults.TARGET_FRACTION,
                                          help="p95 latency target, x deadline (AIMD's)"),
    prior_occupancy: float = typer.Option(0.0, help="rho0: share of the pool held at start"),
    sessions: int = typer.Option(None, min=1, help="N for t_sat (default: the capacity)",
                                 show_default=False),
    as_json: bool = typer.Option(False, "--json", help="print JSON for machines"),
) -> None:
    """Capacity plan: memory ceiling, deadline ceiling N*, which binds, t_sat, AIMD caps."""
    from metronome.plan import PlanRequest, make_plan
    from metronome.plan.report import print_plan

    try:
        inputs = PlanRequest(
            model=model, dtype=dtype, block_size=block_size, pool_tokens=pool_tokens,
            pool_bytes=pool_bytes, gpu_memory=gpu_memory, utilization=utilization,
            weights_bytes=weights_bytes, reserve_bytes=reserve, policy=policy,
            frame_period_s=frame_period_s, deadline_fraction=deadline_fraction,
            input_tokens=tokens_in, output_tokens=tokens_out, session_s=session_s,
            step_cost=step_cost, fixed_s=fixed_s, per_token_s=per_token_s,
            per_context_token_s=per_context_token_s, target_fraction=target_fraction,
            prior_fraction=prior_occupancy, sessions=sessions,
        ).inputs()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    result = make_plan(inputs)
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
    else:
        print_plan(result)


@app.command()
def monitoring(
    out: str = typer.Option("deploy", help="folder for prometheus/ and grafana/"),
    target: str = typer.Option("127.0.0.1:8001", help="the server to scrape (host:port): "
                               "its health listener, which a crowded client port never "
                               "delays"),
) -> None:
    """Write the Prometheus alert rules, a Prometheus config and the Grafana dashboard."""
    from metronome.observe.monitoring import write_monitoring

    for path in write_monitoring(out, target):
        typer.echo(str(path))


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
    audio_dir: str = typer.Option(None, help="folder of speech WAVs (default: the espeak-ng "
                                  "fixtures shipped in the package)", show_default=False),
    api_key: str = typer.Option(None, envvar="METRONOME_API_KEY", show_default=False,
                                help="bearer key (prefer the env variable)"),
    out: str = typer.Option("out/load", help="folder for frames.csv and summary.json"),
    seed: int = typer.Option(0, help="arrival seed (poisson)"),
) -> None:
    """Open N Realtime sessions against a server, stream speech in real time, measure."""
    import asyncio

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
