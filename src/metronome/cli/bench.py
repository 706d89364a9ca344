"""`metronome bench NAME`: every benchmark's command, generated from its module.

A bench preset (`metronome.bench.presets.<module>`) has `NAME`, a frozen `Config` (with
`.smoke()`), `run(ctx, cfg)` and `report(result)`. Its command takes one option per
`Config` field plus `--smoke` (start from `Config.smoke()`; options given still apply) and
`--out` (the JSON; the markdown report and figures go beside it), and runs it through
`metronome.results.context.execute`. A module is imported only when its command runs or
shows its own help: `metronome bench --help` reads each module's docstring from its source,
so the vLLM benches list where vLLM is missing (and refuse to run, saying how to get it).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
from dataclasses import replace
from pathlib import Path

import click
import typer
from typer.core import TyperGroup

from metronome.cli.options import dataclass_options, given_fields, with_signature

# `metronome bench NAME` -> its preset in metronome.bench.presets, and whether it needs vLLM
BENCHES = {
    "engine": ("engine", False),
    "engine-paths": ("engine_paths", False),
    "runtime": ("runtime", False),
    "admission": ("admission", False),
    "plan": ("plan", False),
    "cluster": ("cluster", False),
    "soak": ("soak", False),
    "vad": ("vad", False),
    "voice": ("voice", False),
    "ear": ("ear", False),
    "talkers": ("talkers", False),
    "endless": ("endless", False),
    "instructions": ("instructions", False),
    "resume": ("resume", False),
    "prompt": ("prompt", False),
    "vllm": ("vllm", True),
    "engine-vs-vllm": ("engine_vs_vllm", True),
}
PACKAGE = "metronome.bench.presets"
RESULTS_DIR = Path("docs/results")


def default_out(name: str) -> Path:
    """Where `metronome bench NAME` writes by default: docs/results/<name>.json (- as _)."""
    return RESULTS_DIR / (name.replace("-", "_") + ".json")


def require_vllm(command: str) -> None:
    """Refuse a vLLM command, saying how to get vLLM, where it is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise typer.BadParameter(f"vLLM is not installed in this environment: `make "
                                 f"vllm-install`, then .venv-vllm/bin/metronome {command}"
                                 ) from None


def module_docstring(module_name: str) -> str:
    """A bench module's docstring, read from its source without importing it."""
    spec = importlib.util.find_spec(f"{PACKAGE}.{module_name}")
    return ast.get_docstring(ast.parse(Path(spec.origin).read_text())) or ""


def summary_line(name: str, docstring: str) -> str:
    """The docstring's first paragraph on one line, without its "`metronome bench NAME`: "
    lead (the rest of the docstring says how, for a reader of the module)."""
    first = " ".join(docstring.split("\n\n", 1)[0].split())
    lead = f"`metronome bench {name}`: "
    first = first[len(lead):] if first.startswith(lead) else first
    return first[:1].upper() + first[1:]


def build_command(name: str) -> click.Command:
    """The bench's command: its module imported, its `Config` turned into options."""
    module_name, needs_vllm = BENCHES[name]
    module = importlib.import_module(f"{PACKAGE}.{module_name}")
    from metronome.results.context import RunContext, RunRefused, Scale, execute

    def command(ctx: typer.Context, smoke: bool, out: Path, **values) -> None:
        if needs_vllm:
            require_vllm(f"bench {name}")
        base = module.Config.smoke() if smoke else module.Config()
        try:
            cfg = replace(base, **given_fields(ctx, module.Config, values))
        except (TypeError, ValueError) as err:
            raise typer.BadParameter(str(err)) from None
        try:
            execute(module, RunContext(module.NAME, out_json=out,
                                       scale=Scale.SMOKE if smoke else Scale.FULL), cfg)
        except RunRefused as err:
            typer.secho(f"bench {name}: {err}", fg="red", err=True)
            raise typer.Exit(2) from None

    common = [
        _param("ctx", typer.Context, None),
        _param("smoke", bool, typer.Option(False, help="start from the CI size (Config.smoke()"
                                           "); options given still apply")),
        _param("out", Path, typer.Option(default_out(name), help="the result JSON; the "
                                         "markdown report and figures go beside it")),
    ]
    with_signature(command, common + dataclass_options(module.Config))
    single = typer.Typer(add_completion=False)
    single.command(name=name, help=summary_line(name, module.__doc__ or ""))(command)
    return typer.main.get_command(single)


def _param(name: str, annotation, default) -> inspect.Parameter:
    kind = inspect.Parameter.KEYWORD_ONLY
    if default is None:
        return inspect.Parameter(name, kind, annotation=annotation)
    return inspect.Parameter(name, kind, default=default, annotation=annotation)


class LazyBench(click.Command):
    """A bench as `metronome bench --help` lists it (its docstring's summary); the real
    command is built when it is run or asked for its own help."""

    def __init__(self, name: str) -> None:
        doc = module_docstring(BENCHES[name][0])
        super().__init__(name, help=summary_line(name, doc), short_help=summary_line(name, doc))

    def make_context(self, info_name, args, parent=None, **extra):
        return build_command(self.name).make_context(info_name, args, parent=parent, **extra)


class BenchGroup(TyperGroup):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(BENCHES)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        return LazyBench(cmd_name) if cmd_name in BENCHES else None


bench_app = typer.Typer(cls=BenchGroup, no_args_is_help=True,
                        help="Benchmarks (not tests): each writes a JSON result and a markdown "
                        "report (figures beside it) into docs/results/ unless --out says "
                        "elsewhere.")
