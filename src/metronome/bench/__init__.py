"""`metronome bench`: a tool, not a product. `steps` is the one step timer (systems side by
side, their steps interleaved), `systems` what it times over `EnginePort`, `workload` the one
workload runner (on the beat, wall or virtual clock, or FIFO without it), `server` the one
server launcher; `metronome.load.client` the one WebSocket client and `metronome.results`
the one writer (result JSON -> tables, plots, provenance). Each command is a preset
(`presets/<name>.py`): its knobs, a `run` composing the pieces, one derived number.
"""
