"""`metronome bench instructions`: do a session's instructions survive a long conversation?
Each prompt gives the assistant a name in its instructions (a system message, the session's
first input, as `session.update` sends it), then `turns_factor` x W tokens of conversation
(Hamlet from a different place for each name: `verse`, the user asks for a line of the play's
verse and the assistant says it back; or `dialogue`, the play's lines as they are, speakers'
names and all), then asks its name. The reply follows the instructions if it says that name
(greedy, the bundled model); `exact_style` counts replies in the answer style they fix ("My
name is NAME"). Arms, each a bound as `serve.realtime.bound` makes it: `pinned` (the
instructions are the sinks, scored at rolling positions: as served), `pinned_absolute` (the
same at absolute positions), `sinks` (4 attention sinks, window W: the server's bound without
pinning), `window` (window W only); and two controls: `fresh` (the question right after the
instructions: what the model can do at all) and `unbounded` (the whole conversation kept,
within the model's trained positions). Then the cost of re-pinning new instructions mid-
session (`Engine.repin`: the pinned region prefilled again), by length. Derived number: the
pinned arm's share of replies that follow the instructions.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, replace

from metronome.bench import systems as sy
from metronome.bench.engine.facts import BUNDLED_MODEL
from metronome.bench.presets import Knobs, knob
from metronome.corpus import play_text
from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import Positions, ResidencyPolicy
from metronome.model.weights import load_tokenizer
from metronome.results.context import RunContext
from metronome.results.report import Plot, Report, Table, derived
from metronome.serve.realtime import bound
from metronome.stream import Stream

NAME = "instructions"
NAMES = ("Tobias", "Ada", "Marlowe", "Zephyr", "Octavia", "Leopold", "Imogen", "Casimir",
         "Rosalind", "Thaddeus", "Beatrix", "Evander", "Juniper", "Lysander", "Ottoline",
         "Percival", "Seraphina", "Wendell", "Cordelia", "Barnaby", "Florian", "Matilda",
         "Ignatius", "Philippa")
ARMS = ("pinned", "pinned_absolute", "sinks", "window", "fresh", "unbounded")
FILLERS = ("verse", "dialogue")


@dataclass(frozen=True)
class Config(Knobs):
    prompts: int = knob(24, f"names asked (at most {len(NAMES)}), one conversation each")
    window_tokens: int = knob(512, "W: the bound's window (the server's default)")
    sink_tokens: int = knob(4, "S: attention sinks of the sinks arm")
    turns_factor: float = knob(10.0, "conversation length, in windows")
    filler: str = knob("verse", "the conversation: verse (the user asks for a line of the "
                       "play's verse, the assistant says it back) | dialogue (the play's lines "
                       "as they are, speakers' names and all, as user and assistant turns)")
    reply_tokens: int = knob(16, "tokens of the answer read for the name")
    arms: tuple[str, ...] = knob(ARMS, f"arms, of {', '.join(ARMS)}")
    repin_tokens: tuple[int, ...] = knob((32, 64, 128, 256), "re-pin cost: instruction "
                                         "lengths timed")
    repeats: int = knob(5, "re-pin cost: timings of each length")

    SMOKE = dict(prompts=3, window_tokens=64, turns_factor=3.0, repin_tokens=(32,), repeats=2,
                 arms=("pinned", "window", "fresh"))

    def __post_init__(self) -> None:
        if set(self.arms) - set(ARMS) or not 1 <= self.prompts <= len(NAMES) or (
                self.filler not in FILLERS):
            raise ValueError(f"arms must be of {', '.join(ARMS)}, prompts in [1, "
                             f"{len(NAMES)}], filler one of {', '.join(FILLERS)}")


def instructions(name: str) -> str:
    """A name and a fixed answer style (of four phrasings tried, the one the bundled model
    follows most often right after it: 17 of 24 names)."""
    return (f"You are a helpful assistant. Your name is {name}. If the user asks for your "
            f"name, reply with exactly: My name is {name}.")


def play_lines(filler: str) -> list[str]:
    """Hamlet's lines: all of them (dialogue), or verse only (no speaker's name, no stage
    direction: no persona for the model to take on)."""
    lines = [line.strip() for line in play_text("hamlet").splitlines() if line.strip()]
    if filler == "dialogue":
        return lines
    return [line for line in lines if len(line) > 20 and not line.startswith(("[", "#"))
            and not re.search(r"\b[A-Z]{3,}\b", line)]


def conversation(tokenizer, lines: list[str], start: int, tokens: int, filler: str) -> list[int]:
    """User and assistant turns of the play's lines from `start`, at least `tokens` long."""
    ids, k, role = [], start, "user"
    while len(ids) < tokens:
        text = " ".join(lines[k % len(lines): k % len(lines) + (2 if filler == "verse" else 3)])
        if filler == "verse":
            ids += tokenizer.encode(f"<|im_start|>user\nPlease say back this line of poetry: "
                                    f"{text}<|im_end|>\n<|im_start|>assistant\n{text}"
                                    "<|im_end|>\n").ids
            k += 2
            continue
        ids += tokenizer.encode(f"<|im_start|>{role}\n{text}<|im_end|>\n").ids
        k, role = k + 3, "assistant" if role == "user" else "user"
    return ids


def policy_of(arm: str, cfg: Config, pinned_tokens: int) -> ResidencyPolicy:
    """Each arm's bound, as `serve.realtime.bound` makes it where the server's is S + W."""
    limits = bound.BoundLimits(ResidencyPolicy.sinks_window(cfg.sink_tokens, cfg.window_tokens),
                               16, cfg.window_tokens, 512)
    pinned = bound.pinned(bound.SessionBound(), pinned_tokens, limits).policy(limits)
    return {"pinned": pinned,
            "pinned_absolute": replace(pinned, positions=Positions.ABSOLUTE),
            "sinks": bound.SessionBound().policy(limits),
            "window": ResidencyPolicy.window(cfg.window_tokens)}.get(
                arm, ResidencyPolicy.unbounded())


def ask(engine: Engine, prompts: list[tuple[str, list[int], ResidencyPolicy]],
        reply_tokens: int, tokenizer) -> list[str]:
    """Every prompt as one session, batched; each one's greedy reply."""
    sids = []
    for sid, ids, policy in prompts:
        engine.open_session(Stream(sid, spec=SessionSpec(policy=policy)))
        engine.submit(sid, ids, max_new_tokens=reply_tokens)
        sids.append(sid)
    replies = {sid: [] for sid in sids}
    while engine.has_work:
        out = engine.step()
        for sid in sids:
            replies[sid] += out.new_token_ids.get(sid, [])
    for sid in sids:
        engine.close(sid)
    return [tokenizer.decode(replies[sid]) for sid in sids]


def repin_cost(engine: Engine, tokenizer, cfg: Config) -> list[dict]:
    """ms of `Engine.repin` of n instruction tokens into a session whose window has slid."""
    rows = []
    filler = conversation(tokenizer, play_lines("verse"), 0, 1024, "verse")
    for n in cfg.repin_tokens:
        times = []
        for k in range(cfg.repeats):
            sid = f"repin-{n}-{k}"
            engine.open_session(Stream(sid, spec=SessionSpec(
                policy=ResidencyPolicy.sinks_window(n, 64))))
            engine.submit(sid, filler[:n + 512])
            while engine.has_work:
                engine.step()
            new = (filler[n:] * 2)[:n]
            start = time.perf_counter()
            assert engine.repin(sid, new), "the window has left the pinned region"
            times.append((time.perf_counter() - start) * 1e3)
            engine.close(sid)
        times.sort()
        rows.append({"pinned_tokens": n, "median_ms": times[len(times) // 2],
                     "min_ms": times[0], "max_ms": times[-1]})
    return rows


def run(ctx: RunContext, cfg: Config) -> dict:
    model, tokenizer = sy.load_model(), load_tokenizer()
    ctx.record(model=BUNDLED_MODEL, dtype=sy.DTYPE)
    lines = play_lines(cfg.filler)
    question = tokenizer.encode("<|im_start|>user\nWhat is your name?<|im_end|>\n"
                                "<|im_start|>assistant\n").ids
    length = int(cfg.turns_factor * cfg.window_tokens)
    engine = Engine(model, EngineConfig(pool_tokens=1 << 18, max_sink_tokens=512,
                                        max_prefill_chunk_tokens=256))
    engine.warm_up()
    rows = []
    for arm in cfg.arms:
        prompts = []
        for k, name in enumerate(NAMES[:cfg.prompts]):
            head = tokenizer.encode(f"<|im_start|>system\n{instructions(name)}<|im_end|>\n").ids
            talk = [] if arm == "fresh" else conversation(tokenizer, lines, 97 * k, length,
                                                          cfg.filler)
            prompts.append((f"{arm}-{k}", head + talk + question,
                            policy_of(arm, cfg, len(head))))
        started = time.perf_counter()
        replies = ask(engine, prompts, cfg.reply_tokens, tokenizer)
        ctx.log(f"instructions: {arm}: {time.perf_counter() - started:.0f} s")
        for (_sid, ids, policy), name, reply in zip(prompts, NAMES, replies, strict=False):
            rows.append({"arm": arm, "name": name, "policy": str(policy),
                         "context_tokens": len(ids), "follows": name.lower() in reply.lower(),
                         "exact": reply.strip().startswith(f"My name is {name}"),
                         "reply": reply.strip()})
        ctx.keep("replies", rows)
    table = [{"arm": arm, "prompts": len(mine), "follow": sum(r["follows"] for r in mine),
              "share": sum(r["follows"] for r in mine) / len(mine),
              "exact_style": sum(r["exact"] for r in mine),
              "policy": mine[0]["policy"].split(":")[0] + (
                  "" if arm in ("fresh", "unbounded") else f" {mine[0]['policy']}"),
              "context_tokens": round(sum(r["context_tokens"] for r in mine) / len(mine))}
             for arm in cfg.arms if (mine := [r for r in rows if r["arm"] == arm])]
    pinned = next((t["share"] for t in table if t["arm"] == "pinned"), None)
    return REPORT.finish(ctx, {
        "config": asdict(cfg), "arms": table, "replies": rows,
        "repin": repin_cost(engine, tokenizer, cfg),
        "derived": derived(f"replies that follow the instructions after {cfg.turns_factor:g} x "
                           f"W tokens, pinned", pinned)})


REPORT = Report("Instructions: pinned vs sinks vs window after a long conversation",
                spec=".2f", tables=(
                    Table("Replies that say the name the instructions gave", "arms"),
                    Table("Re-pinning new instructions mid-session (Engine.repin)", "repin"),
                    Table("Every reply", "replies", (("arm", "arm", ""), ("name", "name", ""),
                                                     ("follows", "follows", ""),
                                                     ("exact style", "exact", ""),
                                                     ("reply", "reply", "")))),
                plots=(Plot("{stem}.png", "repin", x="pinned_tokens", ys=("median_ms",)),))
report = REPORT.markdown
