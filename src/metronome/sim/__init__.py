"""Simulation, apart from serving: everything that runs sessions without a server.

The virtual clock (`virtual`: the same beat driven by a modelled step time), the step cost
model and its packaged calibration (`cost_model`, `step_cost.json`), workloads (`workload`),
the per-frame recorder (`recorder`), the local runner behind `metronome run` (`local`), and
the virtual-clock harness (`scenario`: fixed N and admission-controlled runs, `search`: the
N* sweep, `admission`: the AIMD-vs-N* runs). Shared by the tests, `metronome bench` and
`metronome experiment`; `metronome.runtime` is the serving core these drive.
"""
