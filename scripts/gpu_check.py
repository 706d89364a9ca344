"""The GPU check of the sinks+window bound on vLLM's Triton attention: see
`metronome.vllm.gpu_check` (runs from a plain checkout: no install needed on the GPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from metronome.vllm.gpu_check import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
