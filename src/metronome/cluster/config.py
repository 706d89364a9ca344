"""The cluster's options (`metronome serve --replicas N|MIN..MAX ...`), validated once at
the edge.

The server's own options stay in `serve.config.ServerConfig`: every replica runs that config
unchanged. These say how many replicas (a fixed count, or bounds the autoscaler keeps them
within), where Ray is, what each replica gets, and the autoscaler's rule (`cluster.autoscale`).
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

REPLICAS_RANGE = re.compile(r"^\s*(\d+)\s*\.\.\s*(\d+)\s*$")  # MIN..MAX


def parse_replicas(text: str) -> tuple[int, int | None]:
    """`--replicas`: "N" (a fixed count: N, None) or "MIN..MAX" (autoscaled: MIN, MAX)."""
    if text.strip().isdigit():
        return int(text), None
    bounds = REPLICAS_RANGE.match(text)
    if bounds is None:
        raise ValueError(f"--replicas takes N or MIN..MAX (e.g. 1..4), got {text!r}")
    return int(bounds[1]), int(bounds[2])


class ClusterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(ge=1, description="engine replicas, each a whole server (with "
                          "max_replicas: the fewest the autoscaler keeps, and the start)")
    max_replicas: int | None = Field(None, ge=1, description="the most replicas the "
                                     "autoscaler adds (none: a fixed count, no autoscaling)")
    ray_address: str | None = Field(None, description="an existing Ray cluster (`ray start "
                                    "--head` printed it, e.g. 10.0.0.1:6379); none: start a "
                                    "local one in this process")
    replica_cpus: float = Field(1.0, gt=0, description="Ray CPUs each replica reserves")
    replica_gpus: float = Field(0.0, ge=0, description="GPUs each replica reserves (1: one "
                                "GPU per replica)")
    torch_threads: int = Field(1, ge=1, description="torch threads in each replica")
    stats_period_s: float = Field(0.5, gt=0, description="replicas report their admission "
                                  "headroom this often (placement and /v1/cluster)")
    drain_timeout_s: float = Field(600.0, gt=0, description="a replica being removed takes "
                                   "no new session and ends when its sessions have, or after "
                                   "this long")
    session_store_bytes: int = Field(2 << 30, ge=1 << 20, description="memory the "
                                     "session store (on Ray's head) may hold in session "
                                     "checkpoints; a checkpoint past it is not kept (that "
                                     "session does not resume on another replica)")
    # the autoscaler (`cluster.autoscale`); only with a MIN..MAX range
    autoscale_headroom_sessions: int = Field(1, ge=0, description="autoscaling: add a "
                                             "replica when the fleet's free sessions (caps "
                                             "less active) fall below this")
    autoscale_refusal_window_s: float = Field(10.0, gt=0, description="autoscaling: a "
                                              "session refused this recently adds a replica")
    autoscale_cooldown_s: float = Field(5.0, ge=0, description="autoscaling: no decision "
                                        "this long after the last change (and none while a "
                                        "new replica has not reported)")
    autoscale_down_after_s: float = Field(60.0, ge=0, description="autoscaling: remove a "
                                          "replica once the spare headroom has exceeded one "
                                          "replica's cap this long without a break")
    autoscale_metrics_period_s: float = Field(1.0, gt=0, description="autoscaling: replicas "
                                              "record and push their admission stats to "
                                              "Ray's controller this often")

    @model_validator(mode="after")
    def _bounds(self) -> ClusterConfig:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"--replicas {self.replicas}..{self.max_replicas}: MAX < MIN")
        tuned = sorted(f for f in self.model_fields_set if f.startswith("autoscale_"))
        if self.max_replicas is None and tuned:
            flags = ", ".join("--" + f.replace("_", "-") for f in tuned)
            raise ValueError(f"{flags}: only with --replicas MIN..MAX")
        return self

    @property
    def autoscaled(self) -> bool:
        return self.max_replicas is not None

    def actor_options(self) -> dict:
        """Ray Serve's `ray_actor_options` for each replica."""
        options: dict = {"num_cpus": self.replica_cpus}
        if self.replica_gpus:
            options["num_gpus"] = self.replica_gpus
        return options
