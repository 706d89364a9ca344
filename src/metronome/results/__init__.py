"""What every bench and experiment shares to produce a result: the run context (where it
writes, how big it runs, progress, provenance, partial results on interrupt), the facts of
the machine and commit a result was measured at, table helpers, and the one writer of a
bench's report (`report`: the result as markdown tables and PNG plots).

A bench (`metronome.bench.presets.<name>`) or experiment (`metronome.experiments.<name>`) is
one module of one shape: `NAME`, a frozen `Config` dataclass (with `.smoke()`), `run(ctx,
cfg) -> dict` and `report(result) -> str`, the report reading every label from the result
(so no report imports its bench's measuring code)."""
