"""Placement by admission headroom and the cluster view, pure (no Ray): exact ranks; and
the plain `metronome serve` path, which never imports Ray."""

from __future__ import annotations

import subprocess
import sys

from metronome.cluster.board import cluster_view
from metronome.cluster.headroom import ReplicaRoom, headroom, rank


def room(cap: int, active: int, healthy: bool = True, at_s: float = 100.0) -> ReplicaRoom:
    return ReplicaRoom(cap, active, healthy, at_s)


def test_most_room_first_ties_share_a_rank():
    rooms = {"a": room(4, 1), "b": room(4, 3), "c": room(4, 1)}
    assert rank(rooms, {}) == [["a", "c"], ["b"]]


def test_a_full_replica_ranks_after_every_one_with_room_and_one_not_yet_reported():
    rooms = {"full": room(2, 2), "late": None, "room": room(8, 7)}
    assert rank(rooms, {}) == [["room"], ["late"], ["full"]]


def test_all_full_still_ranks_every_replica_so_admission_refuses_instead_of_a_hang():
    rooms = {"a": room(2, 2), "b": room(2, 3), "sick": room(4, 0, healthy=False)}
    assert rank(rooms, {}) == [["a", "b"], ["sick"]]


def test_sessions_placed_after_the_report_count_against_its_room():
    assert headroom(room(4, 1, at_s=100.0), [99.0, 100.0, 100.5]) == 1  # 99.0: counted
    # a burst between two reports alternates instead of piling onto the emptiest
    rooms, placed = {"a": room(2, 0), "b": room(2, 0)}, {"a": [], "b": []}
    for t in (100.1, 100.2, 100.3, 100.4):
        first = rank(rooms, placed)[0][-1]  # (within a rank Ray takes the shorter queue)
        placed[first].append(t)
    assert [len(placed["a"]), len(placed["b"])] == [2, 2]
    assert rank(rooms, placed) == [["a", "b"]]  # both full: both still ranked


def test_stats_round_trip_and_an_unreported_replica():
    assert ReplicaRoom.from_stats(room(3, 1).to_stats()) == room(3, 1)
    assert ReplicaRoom.from_stats({}) is None


def report(status: str = "ok", cap: int = 2, active: int = 1, at_s: float = 100.0) -> dict:
    return {"status": status, "kv_stall": status, "cap": cap, "active_sessions": active,
            "reported_at_s": at_s}


def test_cluster_view_sums_live_replicas_and_marks_a_silent_one_unreachable():
    view = cluster_view({"b": report(at_s=90.0), "a": report("degraded", 4, 3)},
                        now_s=101.0, stale_after_s=2.5)
    assert [r["replica"] for r in view["replicas"]] == ["a", "b"]
    assert [r["status"] for r in view["replicas"]] == ["degraded", "unreachable"]
    assert (view["replicas_live"], view["cap"], view["active_sessions"]) == (1, 4, 3)
    assert (view["status"], view["kv_stall"]) == ("unreachable", "unreachable")
    assert cluster_view({}, 0.0, 1.0)["status"] == "unreachable"


def test_plain_serve_never_imports_ray():
    program = ("import sys; from typer.testing import CliRunner; import metronome.serve.server"
               " as s; s.serve_forever = lambda *a: print('served'); from metronome.cli import"
               " app; r = CliRunner().invoke(app, ['serve', '--model', 'preset:tiny']);"
               " assert r.exit_code == 0 and 'served' in r.output, r.output;"
               " print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.splitlines()[-1] == "False"
