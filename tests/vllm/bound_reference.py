"""The plugin's rule computed by our own engine: the reference the vLLM tests compare with.

Our engine at float32 with the same `sinks_window:S:W` at block size 1, where its
block-aligned window start is token-exact: the same rule as the plugin (vLLM's sliding
window convention, p - j < W). It is teacher-forced over the tokens under test: its greedy
choice at every position equals the tested token iff free-running greedy decoding of the
reference would have produced the same sequence.
"""

from __future__ import annotations

import torch

from metronome.engine.engine import Engine, EngineConfig
from metronome.engine.session import SessionSpec
from metronome.kv.residency import ResidencyPolicy
from metronome.model.weights import load_model
from metronome.stream import Stream
from tests.steps import by_session


def reference(token_ids: list[int], bound: str) -> tuple[list[int], torch.Tensor]:
    """After every prefix token_ids[:i + 1]: the greedy next token and the log-probability
    of the actual token_ids[i + 1]."""
    engine = Engine(load_model("bundled", torch.float32),
                    EngineConfig(block_size=1, pool_tokens=1024, max_chunk_tokens=256,
                                 max_step_tokens=256))
    sid = engine.open_session(Stream.of(SessionSpec(policy=ResidencyPolicy.parse(bound),
                                                    return_logits=True, stop_token_ids=())))
    engine.submit(sid, token_ids[:-1], max_new_tokens=0)
    greedy_ids, chosen, done = [], [], 0
    while engine.has_work:
        for step in by_session(engine.step()).values():
            logprobs = torch.log_softmax(step.logits, dim=-1)  # (chunk, vocab)
            following = torch.tensor(token_ids[done + 1 : done + 1 + len(logprobs)])
            greedy_ids += logprobs.argmax(dim=-1).tolist()
            chosen.append(logprobs[torch.arange(len(logprobs)), following])
            done += len(logprobs)
    return greedy_ids, torch.cat(chosen)
