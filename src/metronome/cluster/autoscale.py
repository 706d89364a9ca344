"""The autoscaler's rule, pure (no Ray): from the replicas' own admission stats, how many
replicas the fleet should run. `cluster.autoscaler` runs it as Ray Serve's autoscaling
policy, on what each replica records for it (`record_autoscaling_stats`).

The signal is admission's, not Ray's request count (a WebSocket is one request for its
whole session, whatever it costs): each replica's effective cap (its AIMD cap within the
KV memory ceiling), its active sessions and the sessions it refused. The fleet's headroom
is the free sessions summed over the running replicas (`cap - active`, none below zero).

    replicas starting or stopping, one not reported yet ─► hold (its room is unknown)
    within `cooldown_s` of the last change taking effect ─► hold (let it show its effect)
    a session refused since then, or headroom < H        ─► one more (up to the max)
    headroom - the largest cap >= H, for `down_after_s`  ─► one fewer (down to the min)
    otherwise                                            ─► hold

One replica a decision, each way: a new replica's room is known only once it reports, and
a removed one drains (its sessions go on until they end, `cluster.replica`). A change takes
effect when every replica Ray runs has reported: the cool-down and the refusals that count
start there, so users refused (and retrying) while the added replica started do not add
another. Removing one leaves at least H free sessions, so a removal never itself triggers
an addition.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

UP, DOWN, HOLD = "up", "down", "hold"
DIRECTIONS = (UP, DOWN)  # the decisions that change the count (the metric's label values)


@dataclass(frozen=True)
class ReplicaLoad:
    cap: int  # sessions its admission takes now (0: unhealthy)
    active: int  # sessions open on it
    refused: int  # sessions it refused in the window the policy asked about

    @property
    def free(self) -> int:
        return max(0, self.cap - self.active)


@dataclass(frozen=True)
class Rules:
    min_replicas: int
    max_replicas: int
    headroom_sessions: int  # H: fewer free sessions than this adds a replica
    cooldown_s: float  # no decision this long after a change
    down_after_s: float  # spare headroom this long, without a break, removes a replica


@dataclass(frozen=True)
class Memory:
    """What the rule remembers between calls (Ray Serve keeps it as the policy's state)."""
    changed_at_s: float | None = None  # the last change (a decision, or a replica starting
    # or stopping: Ray's count not yet reached) was last seen taking effect
    spare_since_s: float | None = None  # spare headroom without a break since


@dataclass(frozen=True)
class Decision:
    replicas: int  # the count wanted from now on
    direction: str  # UP, DOWN or HOLD
    reason: str
    headroom: int | None = None  # the fleet's free sessions (None: not known)
    refused: int = 0  # sessions refused in the window


def decide(target: int, loads: list[ReplicaLoad | None], rules: Rules, memory: Memory,
           now_s: float) -> tuple[Decision, Memory]:
    """`target`: the replica count Ray Serve is heading for; `loads`: one per running
    replica (None: not reported yet)."""
    if len(loads) != target or any(load is None for load in loads):
        return (Decision(target, HOLD, f"{len(loads)} of {target} replicas running and "
                         "reporting"), Memory(changed_at_s=now_s))
    headroom = sum(load.free for load in loads)
    refused = sum(load.refused for load in loads)
    held = Decision(target, HOLD, "", headroom, refused)
    if memory.changed_at_s is not None and now_s - memory.changed_at_s < rules.cooldown_s:
        return replace(held, reason="cooling down"), replace(memory, spare_since_s=None)
    if refused or headroom < rules.headroom_sessions:
        why = (f"{refused} session(s) refused" if refused else
               f"headroom {headroom} < {rules.headroom_sessions}")
        if target >= rules.max_replicas:
            return replace(held, reason=f"{why}, at the max"), memory
        return (replace(held, replicas=target + 1, direction=UP, reason=why),
                Memory(changed_at_s=now_s))
    spare = headroom - max(load.cap for load in loads)
    if spare < rules.headroom_sessions or target <= rules.min_replicas:
        return replace(held, reason="steady"), replace(memory, spare_since_s=None)
    since_s = now_s if memory.spare_since_s is None else memory.spare_since_s
    why = f"headroom {headroom} exceeds one replica's cap by {spare}"
    if now_s - since_s < rules.down_after_s:
        return (replace(held, reason=f"{why} for {now_s - since_s:.0f} s"),
                replace(memory, spare_since_s=since_s))
    return (replace(held, replicas=target - 1, direction=DOWN,
                    reason=f"{why} for {now_s - since_s:.0f} s"), Memory(changed_at_s=now_s))
