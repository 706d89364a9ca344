"""`metronome serve` (every `ServerConfig` and `ClusterConfig` field is an option) and
`metronome cluster scale`, which operates what `serve --replicas N` started."""

from __future__ import annotations

import inspect
import os

import typer

from metronome.cli.options import model_options, shown, with_signature

cluster_app = typer.Typer(no_args_is_help=True, help="Operate a running `metronome serve "
                          "--replicas N` application on its Ray cluster.")


def serve(log_level: str = "info", **options) -> None:
    """Serve the OpenAI Realtime subset over WebSocket (FastAPI + uvicorn): the main job.
    With --replicas N, N such servers behind one endpoint on Ray Serve (`make install`
    installs Ray; without --replicas nothing imports it); --replicas MIN..MAX autoscales."""
    from metronome.cluster.config import ClusterConfig, parse_replicas
    from metronome.serve.config import ServerConfig
    from metronome.serve.server import serve_forever

    fields, cluster_fields = ServerConfig.model_fields, ClusterConfig.model_fields
    cluster_given = {name: options.pop(name) for name in list(options)
                     if name in cluster_fields}
    replicas = cluster_given.pop("replicas")
    cluster_given = {name: value for name, value in cluster_given.items()
                     if value != shown(cluster_fields[name].default)}
    given = {name: value for name, value in options.items()  # defaults stay the config's:
             if value != shown(fields[name].default)}  # some depend on other fields
    if replicas is None and cluster_given:
        flags = ", ".join("--" + name.replace("_", "-") for name in cluster_given)
        raise typer.BadParameter(f"{flags}: only with --replicas N or MIN..MAX")
    try:
        config = ServerConfig(**given)
        cluster = None
        if replicas is not None:
            low, high = parse_replicas(replicas)
            cluster = ClusterConfig(replicas=low, max_replicas=high, **cluster_given)
    except ValueError as err:  # (pydantic's ValidationError is one)
        raise typer.BadParameter(str(err)) from None
    if cluster is None:
        if config.engine == "native":  # before the model loads: runtime.cores says why
            from metronome.runtime.cores import reserve_for_engine_thread

            # a server that hears runs Whisper's pass beside the engine's step: the engine
            # keeps the other cores (oversubscribed OpenMP threads slow every step 2x here)
            hearing = config.audio_input == "transcribe"
            reserve_for_engine_thread(max(1, (os.cpu_count() or 1) - config.whisper_threads)
                                      if hearing else None)
        else:  # vLLM binds its own threads: the GIL switch only (runtime.cores)
            from metronome.runtime.cores import shorten_gil_switch

            shorten_gil_switch()
        serve_forever(config, log_level)
        return
    from metronome.cluster.launch import serve_cluster

    serve_cluster(config, cluster, log_level)


def _serve_options() -> list[inspect.Parameter]:
    from metronome.cluster.config import ClusterConfig
    from metronome.serve.config import ServerConfig

    cluster = [p if p.name != "replicas" else p.replace(  # absent: the plain server
        annotation=str | None, default=typer.Option(None, help="N: engine replicas, each a "
            "whole server, behind Ray Serve; MIN..MAX: autoscaled between them by admission "
            "headroom (none: one plain server, no Ray)", show_default=False))
        for p in model_options(ClusterConfig) if p.name != "max_replicas"]  # (in MIN..MAX)
    return model_options(ServerConfig) + cluster + [inspect.Parameter(
        "log_level", inspect.Parameter.KEYWORD_ONLY, annotation=str,
        default=typer.Option("info", help="uvicorn log level"))]


with_signature(serve, _serve_options())


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
