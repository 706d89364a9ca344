"""The serving core: the beat (per-frame deadlines over an engine), its session records and
frames, the wall-clock driver, and the ports an engine and listeners plug into. Simulation
(virtual clock, cost model, workloads, the local runner) lives in `metronome.sim`."""
