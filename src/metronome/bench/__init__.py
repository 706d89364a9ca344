"""`metronome bench`: a tool, not a product. Four small pieces measure everything:

    steps      the one step timer: systems side by side, their steps interleaved
    systems    what it times: engines behind `EnginePort` with sessions already long, the
               steps they take (decode, chunk, prefill), transformers as a user writes it
    workload   the one workload runner: sessions streaming frames, on the beat (wall or
               virtual clock) or in FIFO order without it
    server     the one server launcher (`metronome serve`, started, awaited, stopped)

`metronome.load.client.Connection` is the one WebSocket client and `metronome.results` the
one writer (result JSON -> markdown tables, PNG plots, provenance). Each command is a preset
(`presets/<name>.py`): its knobs (`Config`), a `run` composing the pieces, and one derived
number with the rows behind it. `engine/` keeps what the engine bench records and fits.
"""
