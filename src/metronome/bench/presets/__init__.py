"""The `metronome bench` commands, one module each (`metronome.cli.bench.BENCHES`): `NAME`,
`Config` (the knobs, with `.smoke()`), `run(ctx, cfg) -> dict` and `report(result) -> str`."""

from dataclasses import field


def knob(default, help: str):
    """A `Config` field: its default and its command-line help."""
    return field(default=default, metadata={"help": help})
