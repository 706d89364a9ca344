"""`metronome`: serve real-time sessions (the main job: `metronome serve`), load-test a
server, run local workloads, reproduce the paper's experiments, and benchmark."""

from __future__ import annotations

import enum
import inspect
import json
import typing
from pathlib import Path

import typer
from pydantic import BaseModel, SecretStr

from metronome.engine.engine import DEFAULT_POOL_TOKENS
from metronome.kv.residency import DEFAULT_POLICY_SPEC

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)
bench_app = typer.Typer(
    no_args_is_help=True, help="Benchmarks (not tests): print JSON, write docs."
)
app.add_typer(bench_app, name="bench")
cluster_app = typer.Typer(no_args_is_help=True, help="Operate a running `metronome serve "
                          "--replicas N` application on its Ray cluster.")
app.add_typer(cluster_app, name="cluster")
POLICY_HELP = "unbounded | window:W | sinks_window:S:W, optionally @rolling"
DTYPE_HELP = "auto (bfloat16 where the CPU has native bf16, else float32) | float32 | bfloat16"


@app.command()
def experiment(
    name: str = typer.Argument(..., help="cliff | admission | predict | quality | all"),
    out: str = typer.Option("out/experiments", help="folder for summary.json, plots, report.md"),
    scale: str = typer.Option("smoke", help="smoke (minutes, CI) | full (docs/results/paper.md)"),
    seed: int = typer.Option(0, help="base seed; every run derives its own from it"),
    step_cost: str = typer.Option(None, help="virtual-clock step cost model (JSON written by "
                                  "`metronome bench engine`, e.g. docs/results/"
                                  "engine_step_cost.json); default: the packaged one",
                                  show_default=False),
) -> None:
    """Reproduce one of the paper's results (or all): writes summary.json, PNG plots and
    report.md into --out (one sub-folder each for `all`)."""
    from metronome.experiments import EXPERIMENTS, Scale, run_experiments

    names = list(EXPERIMENTS) if name == "all" else [name]
    if name != "all" and name not in EXPERIMENTS:
        raise typer.BadParameter(f"unknown experiment {name!r}; choose from "
                                 f"{', '.join(EXPERIMENTS)} or all", param_hint="NAME")
    try:
        chosen = Scale(scale)
    except ValueError:
        raise typer.BadParameter(f"choose smoke or full, got {scale!r}",
                                 param_hint="--scale") from None
    if step_cost is not None and not Path(step_cost).is_file():
        raise typer.BadParameter(f"no such file: {step_cost}", param_hint="--step-cost")
    done = run_experiments(names, out, chosen, seed, None if step_cost is None else Path(step_cost))
    typer.echo(json.dumps({n: {"out": str(folder), "elapsed_s": summary["elapsed_s"]}
                           for n, (folder, summary) in done.items()}, indent=2))


@app.command()
def demo(
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    sessions: int = typer.Option(4, min=1, help="concurrent sessions"),
    frames: int = typer.Option(6, min=1, help="text frames streamed into each session"),
    policy: str = typer.Option("sinks_window:4:64", help=POLICY_HELP),
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
    frame_period_s: float = typer.Option(1.0, help="one frame of input per period"),
    deadline_fraction: float = typer.Option(1.0, help="deadline = fraction x period"),
    tokens_per_frame: int = typer.Option(12, min=1, help="text input tokens per frame"),
    output_tokens: int = typer.Option(4, min=0, help="max output tokens per frame"),
    mode: str = typer.Option("duplex", help="duplex (output every frame) | turn (every 4th)"),
    policy: str = typer.Option(DEFAULT_POLICY_SPEC, help=POLICY_HELP),
    pool_tokens: int = typer.Option(DEFAULT_POOL_TOKENS, min=16, help="KV pool size in tokens"),
    clock: str = typer.Option("wall", help="wall | virtual (deterministic, modelled step time)"),
    input_kind: str = typer.Option("text", "--input", help="text (Hamlet) | audio (front end)"),
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    engine: str = typer.Option("native", help="native | vllm (vLLM + the sinks+window plugin, "
                               "`make vllm-install`; wall clock, text input)"),
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
            clock=clock, input=input_kind, model=model, engine=engine, dtype=dtype, seed=seed,
            out=out, engine_path=engine_path,
        )
        config.profile()
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
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
    policy: str = typer.Option(DEFAULT_POLICY_SPEC, help=POLICY_HELP),
    block_size: int = typer.Option(16, min=1, help="KV block size in tokens"),
    frame_period_s: float = typer.Option(1.0, help="one frame per period"),
    deadline_fraction: float = typer.Option(1.0, help="deadline = fraction x period"),
    tokens_in: int = typer.Option(12, min=0, help="input tokens per frame"),
    tokens_out: int = typer.Option(4, min=0, help="output tokens per frame"),
    session_s: float = typer.Option(3600.0, help="session length"),
    step_cost: str = typer.Option(None, help="step cost model JSON (default: the packaged "
                                  "calibration)", show_default=False),
    fixed_s: float = typer.Option(None, help="step cost: fixed s per step", show_default=False),
    per_token_s: float = typer.Option(None, help="step cost: s per input token",
                                      show_default=False),
    per_context_token_s: float = typer.Option(None, help="step cost: s per attended key",
                                              show_default=False),
    target_fraction: float = typer.Option(0.8, help="p95 latency target, x deadline (AIMD's)"),
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
    target: str = typer.Option("127.0.0.1:8000", help="the server to scrape (host:port)"),
) -> None:
    """Write the Prometheus alert rules, a Prometheus config and the Grafana dashboard."""
    from metronome.observe.monitoring import write_monitoring

    for path in write_monitoring(out, target):
        typer.echo(str(path))


@bench_app.command("engine")
def bench_engine(
    out: str = typer.Option("docs/results/engine.md", help="markdown report to write"),
    json_out: str = typer.Option("docs/results/engine.json", help="raw results to write"),
    smoke: bool = typer.Option(False, help="tiny sizes, for CI"),
    repeats: int = typer.Option(5, min=1, help="timed steps per configuration"),
) -> None:
    """Step latency, tokens/s and resident KV: unbounded vs sinks+window vs transformers."""
    from metronome.bench.engine_bench import run as run_bench

    run_bench(out_md=out, out_json=json_out, smoke=smoke, repeats=repeats)


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
    compare_reference: bool = typer.Option(False, help="run the wall-clock experiment again "
                                           "on the engine's reference path (before/after)"),
) -> None:
    """AIMD admission vs the swept N*: virtual clock (bounded, unbounded) and wall clock."""
    from metronome.bench.admission_bench import run as run_bench

    run_bench(out_md=out, out_json=json_out, smoke=smoke, wall=wall,
              compare_reference=compare_reference)


@bench_app.command("plan")
def bench_plan(
    out: str = typer.Option("docs/results/plan.md", help="markdown report to write"),
    json_out: str = typer.Option("docs/results/plan.json", help="raw results to write"),
    smoke: bool = typer.Option(False, help="two profiles, small pools, for CI"),
    admission_summary: str = typer.Option(None, help="summary.json of `metronome experiment "
                                          "admission`: also compare its swept N*",
                                          show_default=False),
) -> None:
    """`metronome plan`'s predictions (N*, memory ceiling, t_sat) vs virtual-clock runs."""
    from metronome.bench.plan_bench import run as run_bench

    if admission_summary is not None and not Path(admission_summary).is_file():
        raise typer.BadParameter(f"no such file: {admission_summary}",
                                 param_hint="--admission-summary")
    run_bench(out_md=out, out_json=json_out, smoke=smoke, admission_summary=admission_summary)


def _require_vllm(command: str) -> None:
    """Refuse a vLLM command, saying how to get vLLM, where it is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise typer.BadParameter(f"vLLM is not installed in this environment: `make "
                                 f"vllm-install`, then .venv-vllm/bin/metronome {command}"
                                 ) from None


@bench_app.command("vllm")
def bench_vllm(
    out: str = typer.Option("docs/results/vllm.md", help="markdown report (+ .png beside it)"),
    json_out: str = typer.Option("docs/results/vllm.json", help="raw results to write"),
    smoke: bool = typer.Option(False, help="tiny sizes (about 5 min), for CI"),
    stream_duration_s: float = typer.Option(None, min=5.0, help="length of the streaming "
                                            "workload (default 200 s; smoke 12 s)",
                                            show_default=False),
) -> None:
    """Metronome's bound inside vLLM: decode step time vs stock vLLM, its sliding window and
    the native engine; the streaming deadlock, stock vs Metronome on vLLM. Needs vLLM
    (`make vllm-install`; run it from .venv-vllm)."""
    from dataclasses import replace

    from metronome.bench.vllm_bench import VllmBenchConfig
    from metronome.bench.vllm_bench import run as run_bench

    _require_vllm("bench vllm")
    cfg = VllmBenchConfig.smoke() if smoke else VllmBenchConfig()
    cfg = replace(cfg, out_md=out, out_json=json_out)
    if stream_duration_s is not None:
        cfg = replace(cfg, stream_duration_s=stream_duration_s)
    run_bench(cfg)


@bench_app.command("engine-vs-vllm")
def bench_engine_vs_vllm(
    out: str = typer.Option("docs/results/engine_vs_vllm.md",
                            help="markdown report (+ .png beside it)"),
    json_out: str = typer.Option("docs/results/engine_vs_vllm.json", help="raw results"),
    smoke: bool = typer.Option(False, help="tiny sizes (a few minutes), for CI"),
    repeats: int = typer.Option(None, min=1, help="alternating rounds of decode steps "
                                "(default 3; smoke 2)", show_default=False),
) -> None:
    """The native engine vs vLLM on this CPU, side by side: decode tokens/s (unbounded vs
    stock vLLM, sinks+window vs vLLM's sliding window), prefill time, and our GEMMs against
    torch's peak. Needs vLLM (`make vllm-install`; run it from .venv-vllm)."""
    from dataclasses import replace

    from metronome.bench.engine_vs_vllm import EngineVsVllmConfig
    from metronome.bench.engine_vs_vllm import run as run_bench

    _require_vllm("bench engine-vs-vllm")
    cfg = EngineVsVllmConfig.smoke() if smoke else EngineVsVllmConfig()
    cfg = replace(cfg, out_md=out, out_json=json_out)
    if repeats is not None:
        cfg = replace(cfg, repeats=repeats)
    run_bench(cfg)


@bench_app.command("cluster")
def bench_cluster(
    smoke: bool = typer.Option(False, help="one short step of each part (checks the command)"),
    repeats: int = typer.Option(5, min=1, help="proxy-hop runs of each server"),
    out: str = typer.Option("docs/results/cluster.md", help="markdown report (+ .png beside)"),
    json_out: str = typer.Option("docs/results/cluster.json", help="every measurement"),
) -> None:
    """Ray Serve's cost and gain (tiny model, loopback): the proxy hop against the plain
    server side by side, sessions held at <= 1 % deadline misses with 1 vs 2 replicas (AIMD
    on), and Ray's footprint. Prints the summary."""
    from metronome.bench.cluster_bench import ClusterBenchConfig
    from metronome.bench.cluster_bench import run as run_bench

    paths = {"out_md": out, "out_json": json_out}
    config = (ClusterBenchConfig.smoke_size(**paths) if smoke
              else ClusterBenchConfig(repeats=repeats, **paths))
    result = run_bench(config)
    typer.echo(json.dumps({"proxy_hop": result["proxy_hop"]["summary"],
                           "held_sessions": [c["held_sessions"] for c in result["capacity"]],
                           "capacity_ratio": result["capacity_ratio"],
                           "footprint": {k: v for k, v in result["footprint"].items()
                                         if k != "rss_mib_by_process"}}, indent=2))


@bench_app.command("engine-paths")
def bench_engine_paths(
    out: str = typer.Option("docs/results/engine_paths.md", help="markdown report to write"),
    json_out: str = typer.Option("docs/results/engine_paths.json", help="raw results"),
    smoke: bool = typer.Option(False, help="one tiny cell, for CI"),
) -> None:
    """The engine's fast path (paged kernel, prepacked projections) against its reference
    path (dense attention, F.linear), side by side: step time and where a step goes."""
    from metronome.bench.engine_paths import EnginePathsConfig
    from metronome.bench.engine_paths import run as run_bench

    cfg = EnginePathsConfig.smoke(out_md=out, out_json=json_out) if smoke else (
        EnginePathsConfig(out_md=out, out_json=json_out))
    run_bench(cfg)


@bench_app.command("soak")
def bench_soak(
    duration_s: float = typer.Option(1800.0, min=1.0, help="how long clients churn (a few "
                                     "seconds: the smoke size)"),
    sessions: int = typer.Option(3, min=1, help="good clients at once (plus one bad client)"),
    model: str = typer.Option("bundled", help="'bundled', a HF directory, or preset:NAME[:L]"),
    pool_tokens: int = typer.Option(8192, min=16, help="the server's KV pool in tokens"),
    sample_s: float = typer.Option(5.0, min=0.1, help="seconds between samples"),
    out: str = typer.Option("docs/results/soak.md", help="markdown report (+ .png beside it)"),
    json_out: str = typer.Option("docs/results/soak.json", help="samples and verdict"),
) -> None:
    """`metronome serve` in a subprocess under churning sessions (some bad): do its RSS,
    open fds and KV blocks stay flat? Prints the verdict."""
    from metronome.bench.soak_bench import SoakConfig
    from metronome.bench.soak_bench import run as run_bench

    result = run_bench(SoakConfig(duration_s=duration_s, sessions=sessions, model=model,
                                  pool_tokens=pool_tokens, sample_s=sample_s, out_md=out,
                                  out_json=json_out))
    typer.echo(json.dumps(result["verdict"], indent=2))


@bench_app.command("vad")
def bench_vad(
    out: str = typer.Option("docs/results/vad.md", help="markdown report to write"),
    json_out: str = typer.Option("docs/results/vad.json", help="raw results to write"),
) -> None:
    """Server VAD on the espeak-ng fixtures: speech boundaries vs an energy gate, ms per
    512-sample chunk, torch's thread count in a server process around a VAD session."""
    from metronome.bench.vad_bench import run as run_bench

    run_bench(out_md=out, out_json=json_out)


# ---- serve: every ServerConfig field is an option ---------------------------------------------
ENV_VARS = {"api_key": "METRONOME_API_KEY"}


def _cli_annotation(annotation):
    """The type typer parses a config field as (pydantic validates the value after)."""
    if annotation == SecretStr | None:
        return str | None
    if typing.get_origin(annotation) is tuple:
        return list[typing.get_args(annotation)[0]]
    return annotation


def config_default(field):
    """A config field's default as its CLI option shows it."""
    default = field.default
    if isinstance(default, tuple):
        return list(default)
    if isinstance(default, enum.Enum):
        return default.value
    return default


def config_options(model: type[BaseModel]) -> list[inspect.Parameter]:
    """One `--field-name` option per field of `model`, with its default and description."""
    params = []
    for name, field in model.model_fields.items():
        default = config_default(field)
        secret = name in ENV_VARS
        option = typer.Option(None if secret else default, help=field.description,
                              envvar=ENV_VARS.get(name), show_default=not secret)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=_cli_annotation(field.annotation)))
    return params


def serve(log_level: str = "info", **options) -> None:
    """Serve the OpenAI Realtime subset over WebSocket (FastAPI + uvicorn): the main job.
    With --replicas N, N such servers behind one endpoint on Ray Serve (`make install`
    installs Ray; without --replicas nothing imports it)."""
    from pydantic import ValidationError

    from metronome.cluster.config import ClusterConfig
    from metronome.serve.config import ServerConfig
    from metronome.serve.server import serve_forever

    fields, cluster_fields = ServerConfig.model_fields, ClusterConfig.model_fields
    cluster_given = {name: options.pop(name) for name in list(options)
                     if name in cluster_fields}
    replicas = cluster_given.pop("replicas")
    cluster_given = {name: value for name, value in cluster_given.items()
                     if value != config_default(cluster_fields[name])}
    given = {name: value for name, value in options.items()  # defaults stay the config's:
             if value != config_default(fields[name])}  # some depend on other fields
    if replicas is None and cluster_given:
        flags = ", ".join("--" + name.replace("_", "-") for name in cluster_given)
        raise typer.BadParameter(f"{flags}: only with --replicas N")
    try:
        config = ServerConfig(**given)
        cluster = None if replicas is None else ClusterConfig(replicas=replicas,
                                                              **cluster_given)
    except ValidationError as err:
        raise typer.BadParameter(str(err)) from None
    if cluster is None:
        serve_forever(config, log_level)
        return
    from metronome.cluster.launch import serve_cluster

    serve_cluster(config, cluster, log_level)


def _serve_signature() -> None:
    from metronome.cluster.config import ClusterConfig
    from metronome.serve.config import ServerConfig

    cluster = [p if p.name != "replicas" else p.replace(  # absent: the plain server
        annotation=int | None, default=typer.Option(None, min=1, help=ClusterConfig.model_fields[
            "replicas"].description + " behind Ray Serve (none: one plain server, no Ray)",
            show_default=False)) for p in config_options(ClusterConfig)]
    params = config_options(ServerConfig) + cluster + [inspect.Parameter(
        "log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
        default=typer.Option("info", help="uvicorn log level"))]
    serve.__signature__ = inspect.Signature(params, return_annotation=None)
    serve.__annotations__ = {p.name: p.annotation for p in params} | {"return": None}


_serve_signature()
app.command()(serve)


@cluster_app.command("scale")
def cluster_scale(
    replicas: int = typer.Argument(..., min=1, help="the replica count to run from now on"),
    ray_address: str = typer.Option(..., help="the Ray cluster (`metronome serve --replicas` "
                                    "prints it; `ray start --head` for one of your own)"),
) -> None:
    """Scale the running application: new replicas start; removed ones take no new session
    and end when their sessions have, or at their drain timeout (close 1001)."""
    from metronome.cluster.launch import scale

    scale(replicas, ray_address)
    typer.echo(f"metronome: scaling to {replicas} replicas")


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
