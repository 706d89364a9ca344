"""Many engine replicas behind one endpoint, on Ray Serve (`metronome serve --replicas N`).

Each replica is the whole Realtime server of `metronome.serve` (engine, beat, admission,
metrics) in a Ray Serve replica actor; Ray Serve's proxy takes the WebSocket and keeps it on
the replica it was routed to. Modules: `config` (the cluster options), `headroom` (which
replica a new session goes to, pure), `router` (that ranking as Ray Serve's request router),
`board` (the replicas' reports behind `GET /v1/cluster`), `replica` (the deployment class),
`launch` (start Ray, deploy, wait; `metronome cluster scale`); with `--replicas MIN..MAX`,
`autoscale` (how many replicas, from their admission stats, pure), `autoscaler` (that rule
as Ray Serve's autoscaling policy) and `metrics` (its decisions on every replica's
`/metrics`). Only `metronome serve --replicas` and `metronome cluster` import this package
(and `bench cluster`, for `config`'s defaults): the plain server never imports Ray.
"""
