"""The `metronome bench` commands, one module each (`metronome.cli.bench.BENCHES`): `NAME`,
`Config` (the knobs, with `.smoke()`), `run(ctx, cfg) -> dict` and `report(result) -> str`."""

from dataclasses import field


def knob(default, help: str):
    """A `Config` field: its default and its command-line help."""
    return field(default=default, metadata={"help": help})


class Knobs:
    """A preset `Config`'s base: `smoke()` is the CI size, the defaults with `SMOKE`'s values."""

    SMOKE: dict = {}

    @classmethod
    def smoke(cls):
        return cls(**cls.SMOKE)
