"""The voice console: `GET /console` (open: the page holds no data) talks to the server from a
browser, microphone in and speaker out, over `WS /v1/realtime?metronome_events=true`.

One self-contained page (inline script and style, no external URL): Start captures the
microphone (getUserMedia, an AudioWorklet tap), resamples it to 24 kHz mono PCM16 and sends
it as `input_audio_buffer.append` every ~100 ms; the session asks for server VAD, Whisper
transcription and spoken replies. Reply audio (`response.output_audio.delta`) is scheduled
back to back through Web Audio and cut when the user speaks again (`speech_started`:
barge-in). It shows both sides' transcripts as they arrive, each frame's status and latency
(`metronome.frame`), each reply's time to first audio (from the end of the user's speech,
`speech_stopped`, to the reply's first audio delta, on the browser's clock) and its gaps
(`metronome.reply`: where the listener's buffer ran dry), the session's resident KV against
its bound (`GET /v1/status`, once a second) and errors in red. The instructions box sets the
session's instructions (`session.update`) when the session starts and on Apply. With an API
key, open `/console#key=<key>`: the key stays in the
browser and goes out as the WebSocket subprotocol `openai-insecure-api-key.<key>` and as a
bearer header on the status polls. `?autostart=1` starts on load (no click).

`window.consoleState` holds what arrived (transcripts, audio deltas, frames, replies with
their time to first audio and gaps, errors) for a test to read.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

CONSOLE_PAGE_PATH = "/console"


def add_console_routes(app: FastAPI) -> None:
    @app.get(CONSOLE_PAGE_PATH, response_class=HTMLResponse, include_in_schema=False)
    async def console_page() -> str:
        return CONSOLE_HTML


CONSOLE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>metronome console</title>
<style>
 body { font: 14px system-ui, sans-serif; margin: 20px; color: #222; max-width: 900px; }
 h1 { font-size: 18px; margin: 0 0 12px; } button { font-size: 15px; padding: 6px 18px; }
 #state { margin-left: 12px; color: #555; } #errors { color: #c00; white-space: pre-wrap; }
 #log div { margin: 4px 0; } .user b { color: #0550ae; } .assistant b { color: #1a7f37; }
 .pending { color: #888; }
 #kv { width: 400px; height: 14px; border: 1px solid #999; display: inline-block;
       vertical-align: middle; } #kvfill { height: 100%; width: 0; background: #54aeff; }
 #strip span { display: inline-block; width: 9px; height: 14px; margin-right: 1px; }
 .s-ok { background: #2da44e; } .s-late { background: #e8a317; }
 .s-stalled_kv { background: #d1242f; } .s-rejected { background: #8c959f; }
 .s-cancelled { background: #54aeff; } .s-context_full { background: #8250df; }
 section { margin: 12px 0; }
</style></head>
<body>
<h1>metronome console</h1>
<button id="toggle">Start</button><span id="state">idle</span>
<section>KV <span id="kv"><div id="kvfill"></div></span> <span id="kvtext">-</span></section>
<section>frames <span id="strip"></span> <span id="lastframe"></span></section>
<section>replies <span id="replies">-</span></section>
<section><textarea id="instructions" rows="2" cols="60"
  placeholder="instructions, e.g. Answer in detail."></textarea>
<button id="apply">Apply</button></section>
<div id="errors"></div>
<section id="log"></section>
<script>
const key = new URLSearchParams(location.hash.slice(1)).get("key");
const autostart = new URLSearchParams(location.search).get("autostart") === "1";
const RATE = 24000, CHUNK = RATE / 10;  // 100 ms of 24 kHz samples per append
const S = window.consoleState = {userTranscripts: [], assistantTranscripts: [],
  audioDeltas: 0, audioBase64: [], errors: [], frames: [], replies: [], sessionId: null,
  running: false};
let speechStoppedAt = null, replyStart = null;  // the browser's clock (performance.now)
const $ = id => document.getElementById(id);
let ws = null, ctx = null, mic = null, tap = null, pending = [], carry = new Float32Array(0),
  pos = 0, playAt = 0, playing = [], poller = null;
const rows = new Map();  // transcript entry id -> its row in the log


function entry(list, id, who) {  // the transcript entry of an item or a response, made once
  let e = list.find(x => x.id === id);
  if (!e) {
    e = {id, text: "", done: false}; list.push(e);
    const row = document.createElement("div"); row.className = who + " pending";
    $("log").appendChild(row); rows.set(id, row);
  }
  return e;
}
function show(e, who) {
  const row = rows.get(e.id);
  row.innerHTML = "<b>" + who + ":</b> "; row.append(e.text || "…");
  row.classList.toggle("pending", !e.done);
}
function error(text) { S.errors.push(text); $("errors").textContent += text + "\\n"; }
function send(event) { if (ws && ws.readyState === 1) ws.send(JSON.stringify(event)); }

function resample(chunk, ratio) {  // linear interpolation, the fraction carried over chunks
  const buf = new Float32Array(carry.length + chunk.length);
  buf.set(carry); buf.set(chunk, carry.length);
  const out = [];
  for (; pos + 1 < buf.length; pos += ratio) {
    const i = Math.floor(pos), f = pos - i; out.push(buf[i] * (1 - f) + buf[i + 1] * f);
  }
  const keep = Math.floor(pos); carry = buf.slice(keep); pos -= keep;
  return out;
}
function toBase64(samples) {
  const pcm = new Int16Array(samples.length);
  samples.forEach((v, i) => { pcm[i] = Math.max(-1, Math.min(1, v)) * 32767; });
  const bytes = new Uint8Array(pcm.buffer); let s = "";
  for (let i = 0; i < bytes.length; i += 8192)
    s += String.fromCharCode.apply(null, bytes.subarray(i, i + 8192));
  return btoa(s);
}
function onMic(chunk) {
  pending.push(...resample(chunk, ctx.sampleRate / RATE));
  while (pending.length >= CHUNK)
    send({type: "input_audio_buffer.append", audio: toBase64(pending.splice(0, CHUNK))});
}

function play(b64) {  // PCM16 24 kHz, scheduled right after what is already queued
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const pcm = new Int16Array(bytes.buffer, 0, bytes.length >> 1);
  if (!pcm.length) return;
  const buffer = ctx.createBuffer(1, pcm.length, RATE), data = buffer.getChannelData(0);
  pcm.forEach((v, i) => { data[i] = v / 32768; });
  const src = ctx.createBufferSource(); src.buffer = buffer; src.connect(ctx.destination);
  playAt = Math.max(playAt, ctx.currentTime + 0.02); src.start(playAt);
  playAt += buffer.duration; playing.push(src);
  src.onended = () => { playing = playing.filter(x => x !== src); };
}
function bargeIn() {
  playing.forEach(src => { try { src.stop(); } catch (e) {} }); playing = []; playAt = 0;
}

function frame(f) {
  S.frames.push({kind: f.kind, status: f.status, latency_ms: f.latency_ms});
  const span = document.createElement("span");
  span.className = "s-" + f.status; span.title = f.kind + " " + f.status + " " +
    f.latency_ms.toFixed(0) + " ms";
  $("strip").appendChild(span);
  while ($("strip").children.length > 60) $("strip").firstChild.remove();
  $("lastframe").textContent = "last: " + span.title;
}

function replied(r, id) {  // metronome.reply: the reply's gaps, with its time to first audio
  const row = {id, ttfa_ms: replyStart && replyStart.id === id ? replyStart.ttfa_ms : null,
    gap_count: r.gap_count, gap_ms: r.gap_ms, output_tokens: r.output_tokens};
  S.replies.push(row);
  $("replies").textContent = S.replies.slice(-5).map(x =>
    (x.ttfa_ms === null ? "-" : x.ttfa_ms.toFixed(0) + " ms") + " to first audio, " +
    x.gap_count + " gaps (" + x.gap_ms.toFixed(0) + " ms), " + x.output_tokens + " tokens"
  ).join(" | ");
}
function instruct() {
  const text = $("instructions").value.trim();
  if (text) send({type: "session.update", session: {type: "realtime", instructions: text}});
}

function onEvent(ev) {
  const t = ev.type;
  if (t === "session.created") S.sessionId = ev.session.id;
  else if (t === "error") error(ev.error.code + ": " + ev.error.message);
  else if (t === "input_audio_buffer.speech_started") {
    bargeIn(); $("state").textContent = "hearing";
    show(entry(S.userTranscripts, ev.item_id, "user"), "you");  // its row, before the reply's
  }
  else if (t === "input_audio_buffer.speech_stopped") {
    $("state").textContent = "thinking"; speechStoppedAt = performance.now();
  }
  else if (t === "conversation.item.input_audio_transcription.delta") {
    const e = entry(S.userTranscripts, ev.item_id, "user"); e.text += ev.delta; show(e, "you");
  } else if (t === "conversation.item.input_audio_transcription.completed") {
    const e = entry(S.userTranscripts, ev.item_id, "user");
    e.text = ev.transcript; e.done = true; show(e, "you");
  } else if (t === "response.created") {
    S.audioBase64 = []; entry(S.assistantTranscripts, ev.response.id, "assistant");
  } else if (t === "response.output_audio_transcript.delta" || t === "response.output_text.delta") {
    const e = entry(S.assistantTranscripts, ev.response_id, "assistant");
    e.text += ev.delta; show(e, "assistant");
  } else if (t === "response.output_audio.delta") {
    if (!replyStart || replyStart.id !== ev.response_id) replyStart = {id: ev.response_id,
      ttfa_ms: speechStoppedAt === null ? null : performance.now() - speechStoppedAt};
    S.audioDeltas++; S.audioBase64.push(ev.delta); play(ev.delta);
    $("state").textContent = "speaking";
  } else if (t === "response.done") {
    const e = entry(S.assistantTranscripts, ev.response.id, "assistant");
    e.done = true; e.status = ev.response.status; show(e, "assistant");
    $("state").textContent = "listening";
  } else if (t === "metronome.frame") frame(ev.frame);
  else if (t === "metronome.reply") replied(ev.reply, ev.response_id);
}

async function pollKv() {
  try {
    const r = await fetch("/v1/status", key ? {headers: {Authorization: "Bearer " + key}} : {});
    if (!r.ok) throw new Error("GET /v1/status: HTTP " + r.status);
    const me = (await r.json()).sessions.find(x => x.id === S.sessionId);
    if (!me) return;
    const bound = /^sinks_window:(\\d+):(\\d+)/.exec(me.policy) ||
      /^window:()(\\d+)/.exec(me.policy);
    const cap = bound ? Number(bound[1] || 0) + Number(bound[2]) : null;
    const used = me.resident_kv_tokens ?? 0;
    $("kvfill").style.width = cap ? Math.min(100, 100 * used / cap) + "%" : "0";
    $("kvtext").textContent = used + (cap ? " / " + cap : "") + " tokens (" + me.policy + ")";
  } catch (e) { error(String(e)); }
}

async function start() {
  $("toggle").textContent = "Stop"; S.running = true; $("state").textContent = "starting";
  try {
    ctx = new AudioContext();
    mic = await navigator.mediaDevices.getUserMedia({audio: {channelCount: 1,
      echoCancellation: true, noiseSuppression: true}});
    const worklet = "registerProcessor('tap', class extends AudioWorkletProcessor {" +
      " process(inputs) { const ch = inputs[0][0]; if (ch) this.port.postMessage(ch.slice(0));" +
      " return true; } });";
    await ctx.audioWorklet.addModule(URL.createObjectURL(new Blob([worklet],
      {type: "application/javascript"})));
    tap = new AudioWorkletNode(ctx, "tap");
    const mute = ctx.createGain(); mute.gain.value = 0;
    ctx.createMediaStreamSource(mic).connect(tap); tap.connect(mute); mute.connect(ctx.destination);
    const protocols = ["realtime"].concat(key ? ["openai-insecure-api-key." + key] : []);
    ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host +
      "/v1/realtime?metronome_events=true", protocols);
    ws.onopen = () => {
      send({type: "session.update", session: {type: "realtime", output_modalities: ["audio"],
        audio: {input: {format: {type: "audio/pcm", rate: RATE},
                        transcription: {model: "whisper-1"}, turn_detection: {type: "server_vad"}},
                output: {format: {type: "audio/pcm", rate: RATE}}}}});
      instruct();
      tap.port.onmessage = m => onMic(m.data);
      $("state").textContent = ctx.state === "running" ? "listening" :
        "click anywhere to let the page use audio";
    };
    ws.onmessage = m => onEvent(JSON.parse(m.data));
    ws.onerror = () => error("WebSocket error");
    ws.onclose = c => { if (S.running) { error("closed " + c.code + " " + c.reason); stop(); } };
    poller = setInterval(pollKv, 1000);
  } catch (e) { error(String(e)); stop(); }
}
function stop() {
  S.running = false; $("toggle").textContent = "Start"; $("state").textContent = "idle";
  clearInterval(poller); bargeIn();
  if (ws) ws.close(); if (mic) mic.getTracks().forEach(t => t.stop());
  if (ctx) ctx.close(); ws = mic = ctx = tap = null; pending = []; carry = new Float32Array(0);
  pos = 0;
}
$("toggle").onclick = () => S.running ? stop() : start();
$("apply").onclick = instruct;
document.addEventListener("click", () => {  // autoplay policy: audio starts on a gesture
  if (ctx && ctx.state === "suspended")
    ctx.resume().then(() => { $("state").textContent = "listening"; });
});
if (autostart) start();
</script></body></html>
"""
