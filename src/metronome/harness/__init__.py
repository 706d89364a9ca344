"""The experiment harness: virtual-clock scenarios (fixed N, the N* sweep, admission-controlled
runs) and the search for the largest passing N. Shared by the tests, `metronome bench` and
`metronome experiment`; it measures, it does not report."""
