"""Model architecture description (one dataclass) and the architecture-only presets.

The presets carry the attention shapes of the paper's backbones with random weights: their
KV bytes per token decide the memory ceiling, so those must be exact; the FFN is a dense
SwiGLU stand-in where the real model is a mixture of experts (noted per preset).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ModelConfig:
    name: str
    arch: str  # llama | qwen2 | qwen3 | mistral (all share one forward; see model.llama)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool = False  # Qwen2 family
    qk_norm: bool = False  # Qwen3 family: RMSNorm on each head of q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.name}: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        bytes_per_value = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_value

    def with_layers(self, num_layers: int) -> ModelConfig:
        """A shallower copy (to run a preset's shapes on a small machine)."""
        return replace(self, num_layers=num_layers, name=f"{self.name}[{num_layers}L]")

    @classmethod
    def from_hf_dict(cls, cfg: dict, name: str) -> ModelConfig:
        arch = cfg.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ValueError(f"{name}: unsupported model_type {arch!r} (llama/qwen2/qwen3/mistral)")
        heads = cfg["num_attention_heads"]
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise ValueError(f"{name}: rope scaling {rope!r} is not supported")
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            name=name,
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            rope_theta=float(theta),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "qwen2" or cfg.get("attention_bias", False),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


# A 2-layer random Llama: for exact tests, and for virtual-clock experiments whose step
# *time* comes from a cost model, so that real engine steps cost next to nothing.
TINY_LLAMA = ModelConfig(
    name="tiny", arch="llama", vocab_size=96, hidden_size=64, intermediate_size=96,
    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096,
    rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
)

PRESETS: dict[str, ModelConfig] = {
    "tiny": TINY_LLAMA,  # `preset:tiny`: a whole server in a subprocess or replica, for tests
    # Qwen2.5-Omni-7B "thinker" LLM = Qwen2.5-7B shapes.
    "qwen2.5-omni-7b": ModelConfig(
        name="qwen2.5-omni-7b", arch="qwen2", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False, qkv_bias=True,
    ),
    # Moshi's temporal transformer (Helium-7B): 32 layers, 32 heads, no GQA, 3000 positions.
    "moshi-7b": ModelConfig(
        name="moshi-7b", arch="llama", vocab_size=32000, hidden_size=4096,
        intermediate_size=11264, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
        max_position_embeddings=3000, rope_theta=10000.0, rms_norm_eps=1e-8,
        tie_word_embeddings=False,
    ),
    # MiniCPM-o-4.5 LLM backbone = Qwen3-8B shapes.
    "minicpm-o-4.5": ModelConfig(
        name="minicpm-o-4.5", arch="qwen3", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False, qk_norm=True,
    ),
    # Qwen3-Omni-30B-A3B thinker: 48 layers, 32 q heads, 4 kv heads. Its FFN is a mixture of
    # 128 experts (8 active, 768 wide each); here a dense SwiGLU of the active width (8 x 768).
    "qwen3-omni-30b-a3b": ModelConfig(
        name="qwen3-omni-30b-a3b", arch="qwen3", vocab_size=152064, hidden_size=2048,
        intermediate_size=6144, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        max_position_embeddings=65536, rope_theta=1e6, rms_norm_eps=1e-6,
        tie_word_embeddings=False, qk_norm=True,
        note="MoE FFN replaced by a dense SwiGLU of the active expert width (8 x 768)",
    ),
}
