"""Measuring helpers of the benches that drive `metronome serve` processes over their real
sockets (`bench cluster`, `bench soak`): the server subprocess and what it runs on
(`server`), the cluster bench's proxy hop, capacity ladder and Ray footprint (`cluster`)."""
