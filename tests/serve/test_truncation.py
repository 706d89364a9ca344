"""A session's bound through the standard API (`session.truncation`, `serve.realtime.bound`): the
choices map to bounds within the server's ceilings (hypothesis), `session.updated` shows the
one in force and the engine serves it; instructions given first are pinned; and
`conversation.item.truncate` cuts the latest reply, in the item and in the KV."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from websockets.sync.client import connect

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.serve.config import ServerConfig
from metronome.serve.protocol import EXTENSIONS_QUERY, ClientError
from metronome.serve.protocol.schema import RetentionRatio, TokenLimits
from metronome.serve.realtime import bound as truncation
from metronome.serve.realtime.reply import Reply
from metronome.serve.server import ServerThread
from metronome.stream import Stream
from tests.host_speed import UNHURRIED_DEADLINE_FRACTION
from tests.served import TEXT_SERVER, context_in, recv, recv_until

choices = st.one_of(
    st.sampled_from(["auto", "disabled"]),
    st.builds(lambda r, n: RetentionRatio(type="retention_ratio", retention_ratio=r,
                                          token_limits=None if n is None
                                          else TokenLimits(post_instructions=n)),
              st.floats(-0.5, 1.5, allow_nan=False),
              st.one_of(st.none(), st.integers(-10, 5000))))
limits_st = st.builds(
    lambda s, w, block, max_w, max_p, unbounded: truncation.BoundLimits(
        ResidencyPolicy.sinks_window(s, min(w, max_w)), block, max_w, max(max_p, s),
        unbounded),
    st.integers(0, 8), st.integers(16, 1024), st.sampled_from([4, 16, 32]),
    st.integers(32, 4096), st.integers(4, 600), st.booleans())


@settings(max_examples=300, deadline=None)
@given(limits_st, st.lists(st.tuples(choices, st.integers(0, 700), st.booleans()),
                           min_size=1, max_size=6))
def test_a_sessions_bound_never_passes_the_servers_ceilings(limits, updates):
    """Any sequence of session.updates (a truncation choice, instructions of some length,
    input started or not): each is refused with a ClientError or gives a bound within the
    ceilings, and `session.updated`'s truncation says what the bound keeps."""
    bound = truncation.SessionBound()
    for choice, instruction_tokens, started in updates:
        try:
            bound = truncation.choose(choice, bound, limits, started)
            if not started:
                bound = truncation.pinned(bound, instruction_tokens, limits)
        except ClientError as err:
            assert err.param.startswith("session.")
            continue
        policy = bound.policy(limits)
        block = limits.block_size
        if not policy.bounded:
            assert limits.allow_unbounded and bound.truncation == "disabled"
            continue
        assert policy.sink_tokens <= limits.max_pinned_tokens
        after_pin = policy.max_resident_tokens(block) - policy.sink_tokens
        assert after_pin <= max(limits.max_window_tokens, limits.default.window_tokens
                                + block - 1)
        described = bound.describe(limits)
        if isinstance(described, RetentionRatio):
            assert after_pin == described.token_limits.post_instructions
            assert policy.window_tokens >= 1
            step = policy.slide(block)
            # between r x n and n stay: the step is (1 - r) x n in whole blocks, at least one
            n, r = after_pin, described.retention_ratio
            assert step == max(block, min(int((1 - r) * n) // block * block, n // block * block))


def test_what_each_choice_maps_to():
    limits = truncation.BoundLimits(ResidencyPolicy.sinks_window(4, 512), 16, 2048, 512, False)
    auto = truncation.SessionBound()
    assert auto.policy(limits) == ResidencyPolicy.sinks_window(4, 512)
    assert truncation.pinned(auto, 57, limits).policy(limits) == ResidencyPolicy.sinks_window(
        57, 512, "rolling")  # pinned instructions: scored just before the window
    ratio = truncation.choose(RetentionRatio(type="retention_ratio", retention_ratio=0.8,
                                             token_limits=TokenLimits(post_instructions=1000)),
                              auto, limits, started=True)
    assert ratio.policy(limits) == ResidencyPolicy.sinks_window(4, 809, slide_tokens=192)
    with pytest.raises(ClientError, match="--allow-unbounded-sessions"):
        truncation.choose("disabled", auto, limits, started=False)
    with pytest.raises(ClientError, match=r"post_instructions must be in \[16, 2048\]"):
        truncation.choose(RetentionRatio(type="retention_ratio", retention_ratio=1,
                                         token_limits=TokenLimits(post_instructions=4096)),
                          auto, limits, started=False)
    with pytest.raises(ClientError, match="pins at most 512"):
        truncation.pinned(auto, 513, limits)
    allowing = truncation.BoundLimits(limits.default, 16, 2048, 512, True)
    with pytest.raises(ClientError, match="once its input has started"):
        truncation.choose("disabled", auto, allowing, started=True)
    one_bound = truncation.BoundLimits(limits.default, 16, 2048, 512, per_session=False)
    with pytest.raises(ClientError, match="one bound for every session"):
        truncation.choose(ratio.truncation, auto, one_bound, started=False)


def test_the_heard_part_of_a_spoken_reply():
    tokenizer = load_tokenizer()
    ids = tokenizer.encode("The capital of France is Paris. It is big.").ids
    reply = Reply(None, "resp", "item", None, None, ids,
                  [("The capital of France is Paris.", 2000.0), ("It is big.", 1000.0)])
    decode = tokenizer.decode
    assert reply.kept_tokens(3000, decode) == len(ids)
    assert decode(ids[:reply.kept_tokens(2000, decode)]) == "The capital of France is Paris."
    # 60 % of the first sentence's 2 s: its first 18 of 31 characters, back to a whole word
    assert decode(ids[:reply.kept_tokens(1200, decode)]) == "The capital of"
    assert reply.kept_tokens(0, decode) == 0
    assert Reply(None, "resp", "item", None, None, ids).kept_tokens(0, decode) == 0  # no audio


@pytest.fixture(scope="module")
def server(smollm2):
    config = ServerConfig(**(TEXT_SERVER | {"max_response_tokens": 24}), mode="turn",
                          pool_tokens=8192, admission="off", policy="sinks_window:4:64",
                          max_pinned_tokens=128, max_window_tokens=256,
                          deadline_fraction=UNHURRIED_DEADLINE_FRACTION)
    with ServerThread(config, smollm2, load_tokenizer()) as running:
        yield running


def send(ws, **event) -> None:
    ws.send(json.dumps(event))


def ask(ws, text: str) -> list[dict]:
    """A user text item, then `response.create` once it is in: the events up to its
    `conversation.item.done`."""
    send(ws, type="conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]})
    events = recv_until(ws, "conversation.item.done")
    send(ws, type="response.create")
    return events


def turn(ws, text: str) -> list[dict]:
    """A user text item, then a response: the events up to its `response.done`."""
    return ask(ws, text) + recv_until(ws, "response.done", timeout_s=60)


def spoken_server(**overrides) -> ServerConfig:
    """A turn server that speaks its replies, fed text (no Whisper, no VAD), unhurried."""
    return ServerConfig(**{"audio_input": "embeddings", "server_vad": False, "mode": "turn",
                           "pool_tokens": 4096, "admission": "off",
                           "deadline_fraction": UNHURRIED_DEADLINE_FRACTION} | overrides)


def engine_session(server, session_id: str):
    return server.app.state.serving.engine.sessions[session_id]


@pytest.mark.model
def test_truncation_and_pinned_instructions_through_the_api(server):
    with connect(server.ws_url + f"?{EXTENSIONS_QUERY}=true") as ws:
        sid = recv(ws)["session"]["id"]
        instructions = "You are Tobias. Answer in one short sentence."
        send(ws, type="session.update", session={"type": "realtime", "instructions":
                                                 instructions})
        updated = recv(ws)["session"]
        pinned = len(load_tokenizer().encode(
            f"<|im_start|>system\n{instructions}<|im_end|>\n").ids)
        assert updated["truncation"] == "auto"
        assert updated["metronome"]["policy"] == f"sinks_window:{pinned}:64@rolling"
        send(ws, type="session.update", session={"type": "realtime", "truncation": {
            "type": "retention_ratio", "retention_ratio": 0.5,
            "token_limits": {"post_instructions": 128}}})
        updated = recv(ws)["session"]
        assert updated["truncation"] == {"type": "retention_ratio", "retention_ratio": 0.5,
                                         "token_limits": {"post_instructions": 128}}
        assert updated["metronome"]["policy"] == f"sinks_window:{pinned}:65/64@rolling"
        for refused, code in ((
                {"type": "retention_ratio", "retention_ratio": 0.5,
                 "token_limits": {"post_instructions": 257}}, "invalid_value"),
                ("disabled", "unsupported")):
            send(ws, type="session.update", session={"type": "realtime",
                                                     "truncation": refused})
            error = recv(ws)
            assert error["type"] == "error" and error["error"]["code"] == code, error
        send(ws, type="session.update", session={"type": "realtime",
                                                 "instructions": "x " * 400})
        error = recv(ws)
        assert error["error"]["param"] == "session.instructions", error
        assert "pins at most 128" in error["error"]["message"]
        turn(ws, "Hello")
        spec = engine_session(server, sid).spec.policy
        assert spec == ResidencyPolicy.sinks_window(pinned, 65, "rolling", slide_tokens=64)


@pytest.mark.model
def test_truncate_cuts_the_latest_reply_out_of_the_item_and_the_kv(server):
    with connect(server.ws_url) as ws:
        sid = recv(ws)["session"]["id"]
        send(ws, type="conversation.item.create", item={
            "type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Tell me about the city of Paris."}]})
        user_item = recv_until(ws, "conversation.item.done")[-1]["item"]
        send(ws, type="response.create")
        done = recv_until(ws, "response.done", timeout_s=60)[-1]["response"]
        item = done["output"][0]
        engine = engine_session(server, sid)
        before = engine.table.num_tokens
        reply = list(engine.reply)
        assert len(reply) == 24 and before == engine.table.hold_from + 23

        send(ws, type="conversation.item.truncate", item_id=user_item["id"], content_index=0,
             audio_end_ms=0)
        assert recv(ws)["error"]["code"] == "invalid_value"  # a user item
        send(ws, type="conversation.item.truncate", item_id=item["id"], content_index=0,
             audio_end_ms=1)
        error = recv(ws)["error"]
        assert error["param"] == "audio_end_ms" and "past the end" in error["message"]
        send(ws, type="conversation.item.truncate", item_id="item_nope", content_index=0,
             audio_end_ms=0)
        assert recv(ws)["error"]["code"] == "item_not_found"
        send(ws, type="conversation.item.truncate", item_id=item["id"], content_index=0,
             audio_end_ms=0)
        truncated = recv(ws)
        assert truncated == truncated | {"type": "conversation.item.truncated",
                                         "item_id": item["id"], "content_index": 0,
                                         "audio_end_ms": 0}
        assert engine.table.num_tokens == before - 23 and engine.carry is None
        send(ws, type="conversation.item.retrieve", item_id=item["id"])
        assert recv(ws)["item"]["content"][0]["text"] == ""
        # the next turn reads on from the cut (and the old reply can no longer be cut)
        turn(ws, "And of France?")
        send(ws, type="conversation.item.truncate", item_id=item["id"], content_index=0,
             audio_end_ms=0)
        assert "no longer be truncated" in recv(ws)["error"]["message"]


@pytest.mark.model
def test_instructions_changed_mid_session_are_re_pinned(server):
    tokenizer = load_tokenizer()
    with connect(server.ws_url + f"?{EXTENSIONS_QUERY}=true") as ws:
        sid = recv(ws)["session"]["id"]
        send(ws, type="session.update", session={"type": "realtime",
                                                 "instructions": "You are Tobias."})
        recv_until(ws, "session.updated")  # the instructions are queued,
        context_in(server, sid)  # then in the KV
        for k in range(4):  # past the 64-token window: the first instructions' blocks free
            send(ws, type="conversation.item.create", item={
                "type": "message", "role": "user", "content": [{
                    "type": "input_text", "text": f"Line {k}: to be, or not to be, that is "
                    "the question, whether 'tis nobler in the mind to suffer."}]})
            recv_until(ws, "conversation.item.done")
            context_in(server, sid)  # one at a time
        second = "You are Ada, a terse assistant. Answer in one short sentence."
        send(ws, type="session.update", session={"type": "realtime", "instructions": second})
        recv(ws)
        send(ws, type="conversation.item.create", item={
            "type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "What is your name?"}]})
        events = recv_until(ws, "conversation.item.done")
        send(ws, type="response.create")
        events += recv_until(ws, "response.done", timeout_s=60)
        bounded = [e for e in events if e["type"] == "metronome.session.bounded"]
        pinned = len(tokenizer.encode(f"<|im_start|>system\n{second}<|im_end|>\n").ids)
        assert [(e["bound"]["reason"], e["bound"]["policy"]) for e in bounded] == [
            ("pinned", f"sinks_window:{pinned}:64@rolling")]
        assert engine_session(server, sid).spec.policy.sink_tokens == pinned
        send(ws, type="session.update", session={"type": "realtime"})
        assert recv(ws)["session"]["metronome"]["policy"] == f"sinks_window:{pinned}:64@rolling"


@pytest.mark.model
def test_a_spoken_reply_is_cut_where_its_audio_stopped(smollm2):
    """Barge-in as the Agents SDK does it: the reply was played up to `audio_end_ms`; the
    item's transcript ends at the last whole word heard and the KV at its last token."""
    config = spoken_server(max_response_tokens=24)
    tokenizer = load_tokenizer()
    with ServerThread(config, smollm2, tokenizer) as running, connect(running.ws_url) as ws:
        sid = recv(ws)["session"]["id"]
        events = turn(ws, "Tell me about the city of Paris.")
        done = events[-1]["response"]
        transcript = done["output"][0]["content"][0]["transcript"]
        audio_bytes = sum(len(e["delta"]) * 3 // 4 for e in events
                          if e["type"] == "response.output_audio.delta")
        audio_ms = audio_bytes / 48
        session = engine_session(running, sid)
        reply, start = list(session.reply), session.table.hold_from
        half = int(audio_ms / 2)
        send(ws, type="conversation.item.truncate", item_id=done["output"][0]["id"],
             content_index=0, audio_end_ms=half)
        assert recv(ws)["type"] == "conversation.item.truncated"
        send(ws, type="conversation.item.retrieve", item_id=done["output"][0]["id"])
        cut = recv(ws)["item"]["content"][0]["transcript"]
        kept = len(session.reply)
        assert 0 < kept < len(reply) and session.reply == reply[:kept]
        assert cut == tokenizer.decode(reply[:kept]) and transcript.startswith(cut.strip())
        assert 0.25 < len(cut) / len(transcript) < 0.75, (cut, transcript)
        assert session.table.num_tokens == start + kept - 1 and session.carry == reply[kept - 1]


@pytest.mark.model
def test_a_long_reply_cancelled_mid_way_is_cut_where_heard_across_window_slides(smollm2):
    """A reply of up to 200 tokens under a 32-token window: the window slides twice or more
    during it before the user speaks up, yet the rewind horizon holds where it began, so a
    barge-in (`response.cancel` while it is still spoken, then a truncate where playback
    stopped, as the Agents SDK does) leaves the KV at the last heard token: the kept tokens
    are the reply's first ones, the table ends right after them, and the session held no more
    blocks than the memory ceiling counts for it (`blocks_per_session` with the server's
    reply length)."""
    from metronome.engine.engine import blocks_per_session

    policy = ResidencyPolicy.parse("sinks_window:4:32")
    config = spoken_server(policy=str(policy), max_response_tokens=200)
    tokenizer = load_tokenizer()
    with ServerThread(config, smollm2, tokenizer) as running, connect(running.ws_url) as ws:
        sid = recv(ws)["session"]["id"]
        ask(ws, "Tell me about the city of Paris in detail.")
        events, audio_bytes = [], 0
        session = engine_session(running, sid)
        # 2 s of its audio sent and two windows written: the user speaks up
        while audio_bytes < 2 * 24000 * 2 or len(session.reply) <= 64:
            events.append(event := recv(ws, timeout_s=60))
            assert event["type"] not in ("error", "response.done"), event
            if event["type"] == "response.output_audio.delta":
                audio_bytes += len(event["delta"]) * 3 // 4
        send(ws, type="response.cancel")
        events += recv_until(ws, "response.done", timeout_s=60)
        done = events[-1]["response"]
        assert done["status"] == "cancelled", done["status_details"]
        reply, start = list(session.reply), session.table.hold_from
        assert 64 < len(reply) <= 200 and start is not None  # cut mid-way, still held
        assert policy.window_start(session.table.num_tokens, 16) > start  # it slid past
        item_id = done["output"][0]["id"]
        send(ws, type="conversation.item.truncate", item_id=item_id, content_index=0,
             audio_end_ms=1500)  # heard: the first 1.5 s
        assert recv(ws)["type"] == "conversation.item.truncated"
        send(ws, type="conversation.item.retrieve", item_id=item_id)
        cut = recv(ws)["item"]["content"][0]["transcript"]
        kept = len(session.reply)
        assert 0 < kept < 40 and session.reply == reply[:kept], (kept, len(reply))
        assert cut == tokenizer.decode(reply[:kept])
        assert session.table.num_tokens == start + kept - 1 and session.carry == reply[kept - 1]
        peak = blocks_per_session(policy, running.app.state.serving.engine.config)
        assert running.app.state.serving.engine.session_blocks(sid) <= peak


@pytest.mark.model
def test_instructions_stay_pinned_through_ten_windows_of_conversation(server):
    """After 10 x W tokens the pinned blocks still hold the instructions' KV bit for bit as
    the session wrote it, while the window slid ten times over; and that KV is the one a fresh
    session writes for them (to float rounding: the server's step may batch the prefill with
    another session's work, and a matmul's rounding follows its row count on some hosts)."""
    tokenizer = load_tokenizer()
    instructions = "You are Tobias. Answer in one short sentence."
    ids = tokenizer.encode(f"<|im_start|>system\n{instructions}<|im_end|>\n").ids
    serving = server.app.state.serving

    def instructions_k(sid: str) -> torch.Tensor:
        table = engine_session(server, sid).table
        block = table.block_size
        slots = [table.logical_to_block_id[p // block] * block + p % block
                 for p in range(len(ids))]
        return serving.engine.cache.k[:, :, slots].clone()

    with connect(server.ws_url + f"?{EXTENSIONS_QUERY}=true") as ws:
        sid = recv(ws)["session"]["id"]
        send(ws, type="session.update", session={"type": "realtime",
                                                 "instructions": instructions})
        recv_until(ws, "session.updated")  # queued (context_in alone may look before that)
        context_in(server, sid)
        written_k = instructions_k(sid)
        line = "To be, or not to be, that is the question: whether 'tis nobler in the mind."
        while engine_session(server, sid).table.num_tokens < 10 * 64 + len(ids):
            send(ws, type="conversation.item.create", item={
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": line}]})
            recv_until(ws, "conversation.item.done")
            context_in(server, sid)
        session = engine_session(server, sid)
        table, block = session.table, session.table.block_size
        assert session.spec.policy.sink_tokens == len(ids)
        kept = [k for k in table.logical_to_block_id if k * block < len(ids)]
        assert kept == list(range(-(-len(ids) // block)))  # every pinned block is resident
        assert min(k for k in table.logical_to_block_id if k not in kept) * block > 10 * 64 - 64
        pinned_k = instructions_k(sid)
    torch.testing.assert_close(pinned_k, written_k, rtol=0, atol=0)
    fresh = Engine(serving.engine.model, EngineConfig(block_size=block, pool_tokens=1024))
    fresh.open_session(Stream("fresh", spec=SessionSpec(
        policy=ResidencyPolicy.sinks_window(len(ids), 64, "rolling"))))  # as pinned
    fresh.submit("fresh", ids)
    while fresh.has_work:
        fresh.step()
    own = fresh.sessions["fresh"].table.logical_to_block_id
    fresh_k = fresh.cache.k[:, :, [own[p // block] * block + p % block for p in range(len(ids))]]
    # CI's host once differed by 4.6e-5 at most; a position off by one moves K by whole units
    torch.testing.assert_close(pinned_k, fresh_k, rtol=1e-3, atol=1e-3)


def test_a_session_past_the_position_limit_keeps_rolling_whatever_it_chooses():
    limits = truncation.BoundLimits(ResidencyPolicy.sinks_window(4, 512), 16, 2048, 512, False)
    rolled = truncation.SessionBound(rolled=True)
    assert rolled.policy(limits) == ResidencyPolicy.sinks_window(4, 512, "rolling")
    chosen = truncation.choose(RetentionRatio(type="retention_ratio", retention_ratio=1.0),
                               rolled, limits, started=True)
    assert chosen.policy(limits).positions.value == "rolling"
    assert truncation.SessionBound.load(chosen.saved()) == chosen
