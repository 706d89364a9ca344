"""The cluster's options (`metronome serve --replicas N ...`), validated once at the edge.

The server's own options stay in `serve.config.ServerConfig`: every replica runs that config
unchanged. These say how many replicas, where Ray is, and what each replica gets.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ClusterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    replicas: int = Field(ge=1, description="engine replicas, each a whole server")
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

    def actor_options(self) -> dict:
        """Ray Serve's `ray_actor_options` for each replica."""
        options: dict = {"num_cpus": self.replica_cpus}
        if self.replica_gpus:
            options["num_gpus"] = self.replica_gpus
        return options
