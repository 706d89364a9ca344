"""The live status page: `GET /status` (a page with no data of its own, open) polls
`GET /v1/status` (the data, behind the API key like every other route) once a second.

Shows what an operator needs to see the silent cliff: health and its reason, goodput next to
the deadline-met share, the KV pool and its saturation forecast, the admission cap, and one
row per session with a strip of its last frames' statuses (green ok, amber late, red
stalled on KV), so frames that go out on time but empty are visible at a glance.

Owns two server-wide counts (`StatusBoard`, a runtime listener: frames answered, and how many
met their deadline); each session's strip is its stream's `recent_statuses`, and everything
else is read from the serving state when a page asks. With an
API key, open the page as `/status#key=<key>`: the key stays in the browser (a fragment is
never sent) and goes out as a bearer header on each poll.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse

from metronome.stream import Frame, Stream

STATUS_PAGE_PATH = "/status"
STATUS_DATA_PATH = "/v1/status"


class StatusBoard:
    """Frames answered since the server started, and how many met their deadline."""

    def __init__(self) -> None:
        self._frames = 0
        self._deadline_met = 0

    def on_result(self, result: Frame) -> None:
        self._frames += 1
        self._deadline_met += result.deadline_met

    @property
    def frames(self) -> int:
        """Frames answered since the server started."""
        return self._frames

    @property
    def deadline_met_fraction(self) -> float | None:
        return self._deadline_met / self._frames if self._frames else None


def _strip(stream: Stream | None) -> list[str]:
    return [] if stream is None else [status.value for status in list(stream.recent_statuses)]


def status_snapshot(serving, board: StatusBoard) -> dict:
    """What the page shows, as JSON (`serving` is the server's `Serving`)."""
    health = serving.health()
    streams = serving.beat.streams
    sessions = [item | {"strip": _strip(streams.get(item["id"]))}
                for item in serving.session_list()["data"]]
    pool = serving.pool
    observer = serving.observer
    return {
        "status": health["status"], "reason": health.get("reason"),
        "goodput_ratio": _finite(observer.metrics.goodput_ratio()),
        "deadline_met_fraction": board.deadline_met_fraction,
        "frames": board.frames,
        "kv_pool": {"num_blocks": pool.num_blocks, "used_blocks": pool.used_blocks,
                    "free_blocks": pool.free_blocks, "pinned_blocks": pool.pinned_blocks,
                    "saturation_eta_s": _finite(observer.eta_s)},
        "admission": health.get("admission", {}),
        "sessions": sessions,
    }


def _finite(value: float) -> float | None:
    return None if value != value or value in (float("inf"), float("-inf")) else value


def add_status_routes(app: FastAPI, board_of, data_dependencies=()) -> None:
    """`board_of(request)` gives the running server's StatusBoard; `data_dependencies` guard
    the data route (the page itself holds no data)."""

    @app.get(STATUS_PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def status_page() -> str:
        return STATUS_HTML

    @app.get(STATUS_DATA_PATH, dependencies=list(data_dependencies))
    async def status_data(request: Request) -> dict:
        return status_snapshot(request.app.state.serving, board_of(request))


STATUS_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>metronome status</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 20px; color: #222; }
 h1 { font-size: 18px; margin: 0 0 12px; }
 .cards { display: flex; gap: 12px; flex-wrap: wrap; margin-bottom: 16px; }
 .card { border: 1px solid #ccc; border-radius: 6px; padding: 8px 12px; min-width: 150px; }
 .card b { display: block; font-size: 20px; }
 .ok { color: #1a7f37; } .degraded { color: #b35900; } .critical { color: #c00; }
 table { border-collapse: collapse; } td, th { padding: 3px 8px; text-align: left; }
 .strip span { display: inline-block; width: 9px; height: 14px; margin-right: 1px; }
 .s-ok { background: #2da44e; } .s-late { background: #e8a317; }
 .s-stalled_kv { background: #d1242f; } .s-rejected { background: #8c959f; }
 .s-cancelled { background: #54aeff; } .s-context_full { background: #8250df; }
 #error { color: #c00; }
</style></head>
<body>
<h1>metronome <span id="status" data-value="">…</span></h1>
<div id="reason"></div><div id="error"></div>
<div class="cards">
 <div class="card">frames answered<b id="frames" data-value="">-</b></div>
 <div class="card">goodput<b id="goodput" data-value="">-</b></div>
 <div class="card">deadline met<b id="deadline_met" data-value="">-</b></div>
 <div class="card">KV pool used<b id="pool" data-value="">-</b><span id="eta"></span></div>
 <div class="card">admission cap<b id="cap" data-value="">-</b></div>
 <div class="card">sessions<b id="sessions" data-value="">-</b></div>
</div>
<table><thead><tr><th>session</th><th>mode</th><th>age s</th><th>resident KV</th>
<th>last frames (oldest left)</th></tr></thead><tbody id="rows"></tbody></table>
<script>
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const pct = v => v === null || v === undefined ? "-" : (100 * v).toFixed(1) + " %";
function set(id, text, value) {
  const el = document.getElementById(id);
  el.textContent = text; el.dataset.value = value === null ? "" : String(value);
}
async function poll() {
  try {
    const r = await fetch("/v1/status", key ? {headers: {Authorization: "Bearer " + key}} : {});
    if (!r.ok) throw new Error("GET /v1/status: HTTP " + r.status);
    const s = await r.json();
    const st = document.getElementById("status");
    st.className = s.status; set("status", s.status, s.status);
    document.getElementById("reason").textContent = s.reason || "";
    set("frames", String(s.frames), s.frames);
    set("goodput", pct(s.goodput_ratio), s.goodput_ratio);
    set("deadline_met", pct(s.deadline_met_fraction), s.deadline_met_fraction);
    const p = s.kv_pool;
    set("pool", p.used_blocks + " / " + p.num_blocks, p.used_blocks);
    document.getElementById("eta").textContent = p.saturation_eta_s === null ?
      "full: never" : "full in " + p.saturation_eta_s.toFixed(0) + " s";
    const cap = s.admission.effective_cap ?? s.admission.cap;
    const off = cap === undefined || cap >= 2147483647;  // admission off: no cap
    set("cap", off ? "off" : String(cap), off ? null : cap);
    set("sessions", String(s.sessions.length), s.sessions.length);
    document.getElementById("rows").innerHTML = s.sessions.map(x =>
      `<tr data-session="${x.id}"><td>${x.id}</td><td>${x.mode}</td><td>${x.age_s}</td>` +
      `<td>${x.resident_kv_tokens ?? "-"}</td><td class="strip">` +
      x.strip.map(f => `<span class="s-${f}" title="${f}"></span>`).join("") + `</td></tr>`
    ).join("");
    document.getElementById("error").textContent = "";
    document.body.dataset.updated = String(Date.now());
  } catch (e) { document.getElementById("error").textContent = String(e); }
}
poll(); setInterval(poll, 1000);
</script></body></html>
"""
