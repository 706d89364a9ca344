"""The compiled kernels: paged attention (`csrc/paged_attention.cpp`, with vectorised tasks for
bf16 on AVX512-BF16 and float32 on AVX2 with FMA in `attend_*.h`), the fused elementwise
ops of the forward pass (`csrc/fused_ops.cpp`), the attention probabilities of long dense
chunks (`csrc/prefill_attention.cpp`, used on AVX512-BF16 CPUs without AMX) and the few-row
projections of decode steps (`csrc/small_linear.cpp`: bf16 on AVX512-BF16, float32 on AVX2
with FMA). Each is built on first use and cached.

`kernel()` returns the loaded extension, or None when it cannot be built here (no C++
compiler, no ninja): then `unavailable_reason()` says why and the engine runs the dense
reference path (`metronome.model.llama`), which gives the same results. `make install`
builds it once (`python -m metronome.model.native`) so the first session does not wait
for the compiler (~1 min on 2 cores).

The build is specific to this CPU (`-march=native`) and this venv's torch: its cache folder
is named after a hash of the CPU's model and flags, the venv and the torch version, so a
cache shared with another machine or venv is never reused.
Under METRONOME_CPU=float32 (`metronome.model.cpu`) they build without their bf16 tasks, into
folders of their own, as on a host without AVX512-BF16.
Set METRONOME_NATIVE_ATTENTION=0 to never build or load it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

from metronome.model.cpu import cpuinfo_field, proc_lines

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
FUSED_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.cpp"
PREFILL_SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.cpp"
SMALL_LINEAR_SOURCE = Path(__file__).parent / "csrc" / "small_linear.cpp"
DISABLE_ENV = "METRONOME_NATIVE_ATTENTION"
# -ffast-math lets GCC use glibc's vector expf in the softmax loop; the kernel uses no
# infinities or NaNs (a finite sentinel masks). Compile flags only: linking a shared object
# with -ffast-math could flip the process's denormal mode.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]

def _cpu_tag() -> str:
    """Hash of what the build depends on: this CPU (model, flags), this Python environment
    (its torch headers and ABI), the torch version and the host kind forced on it (a float32
    host's build lacks the bf16 tasks: `metronome.model.cpu`)."""
    import torch

    from metronome.model import cpu

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    text = "\n".join(sorted(set(lines)) + [platform.machine(), sys.prefix, torch.__version__]
                     + cpu.kernel_cflags())
    return hashlib.sha256(text.encode()).hexdigest()[:10]


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold `directory`'s build lock (an flock, released when its holder dies) while
    building into it. torch's cpp_extension marks a build in progress with a file of its
    own (`lock`) and waits, silently and for ever, while that file exists; a build killed
    mid-way leaves it behind (seen: a bench hung in the kernel's load after a killed run).
    Every build here takes this lock first, so whoever holds it finds torch's file stale
    whenever it is there, and removes it, saying so."""
    import fcntl

    with open(directory / "metronome.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = directory / "lock"
        if stale.exists():
            log.warning("removing %s, left by a build that was killed mid-way", stale)
            stale.unlink(missing_ok=True)
        yield


class Extension:
    """One C++ source compiled with torch's cpp_extension on first use, cached per
    CPU/venv/torch (`build_dir`), or None with the reason when it cannot be built here."""

    def __init__(self, name: str, source: Path, what: str, configure=None) -> None:
        """`configure(module)`: run once on the module when it loads (its settings for this
        CPU)."""
        self.name, self.source, self.what = name, source, what
        self.configure = configure
        self._lock = threading.Lock()
        self._state: dict[str, object] = {}

    def build_dir(self) -> Path:
        from metronome.model.cache_root import cache_dir

        return cache_dir() / "native" / f"{self.name}_{_cpu_tag()}"

    def module(self):
        """The loaded extension module, or None if it cannot be built (see `reason`)."""
        with self._lock:
            if "module" not in self._state:
                module, self._state["reason"] = self._load()
                if module is not None and self.configure is not None:
                    self.configure(module)
                self._state["module"] = module
            return self._state["module"]

    def reason(self) -> str | None:
        """Why `module()` is None (None when it loaded, or before the first call)."""
        return self._state.get("reason")  # type: ignore[return-value]

    def _load(self):
        if os.environ.get(DISABLE_ENV, "1") == "0":
            return None, f"disabled by {DISABLE_ENV}=0"
        from metronome.model import cpu

        try:
            import torch.utils.cpp_extension as cpp
        except ImportError as err:  # pragma: no cover - torch always ships it
            return None, f"torch.utils.cpp_extension unavailable: {err}"
        directory = self.build_dir()
        directory.mkdir(parents=True, exist_ok=True)
        fresh = not any(directory.glob("*.so"))
        if fresh:
            print(f"metronome: compiling the {self.what} into {directory} "
                  "(first use on this machine, about a minute)...", file=sys.stderr, flush=True)
        started = time.perf_counter()
        try:
            with build_lock(directory):
                module = cpp.load(name=f"metronome_{self.name}_{_cpu_tag()}",
                                  sources=[str(self.source)],
                                  extra_cflags=CFLAGS + cpu.kernel_cflags(),
                                  extra_ldflags=["-fopenmp"], build_directory=str(directory),
                                  verbose=False)
        except (RuntimeError, OSError, ImportError, SystemExit) as err:
            last = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            reason = f"the {self.what} could not be built ({type(err).__name__}: {last}); " \
                     "a C++ compiler (g++) and the ninja package are needed"
            log.warning("%s; using the reference path (same results, slower)", reason)
            return None, reason
        if fresh:
            print(f"metronome: {self.what} built in {time.perf_counter() - started:.0f} s",
                  file=sys.stderr, flush=True)
        return module, None


def _configure_paged(module) -> None:
    module.set_bf16_far_prefetch(far_prefetch_pays(proc_lines("/proc/cpuinfo")))


PAGED = Extension("paged_attention", SOURCE, "paged-attention kernel", _configure_paged)
FUSED = Extension("fused_ops", FUSED_SOURCE, "fused elementwise kernels")
PREFILL = Extension("prefill_attention", PREFILL_SOURCE, "prefill attention kernel")
SMALL_LINEAR = Extension("small_linear", SMALL_LINEAR_SOURCE, "few-row projection kernel")


def build_dir() -> Path:
    return PAGED.build_dir()


def kernel():
    """The extension module (its `paged_attention` function), or None if it cannot be built;
    its bf16 task's prefetch set for this CPU (`far_prefetch_pays`) when it loaded."""
    return PAGED.module()


def far_prefetch_pays(cpuinfo: list[str]) -> bool:
    """Does the bf16 attention task gain from asking for the block after next as well as
    the next one? Measured side by side (`scripts/attention_ab.py`, K/V from memory): on an
    AVX512-BF16 Zen 4 EPYC, 0.84x the time with it; on a Sapphire Rapids-class Xeon, 1.12x
    at 8 bounded sessions and 1.16x at 32 sessions x 4k unbounded. So: on AMD CPUs only."""
    return cpuinfo_field(cpuinfo, "vendor_id") == "AuthenticAMD"


def unavailable_reason() -> str | None:
    """Why `kernel()` is None (None when it loaded, or before the first `kernel()` call)."""
    return PAGED.reason()


def fused_ops():
    """The fused elementwise ops module (rms_norm, add_rms_norm, silu_mul, rope), or None if
    it cannot be built here (`FUSED.reason()` says why; the model then runs torch's ops)."""
    return FUSED.module()


def prefill_attention():
    """The long-chunk attention module (`attention_probs`), or None where it cannot be built
    or this CPU has no AVX512-BF16 (the dense path then runs torch's SDPA)."""
    module = PREFILL.module()
    return module if module is not None and module.available() else None


def sdpa_packs_amx_tiles() -> bool:
    """Does torch's CPU flash attention run its bf16 tiles on AMX here? It packs them for
    oneDNN's brgemm only where the CPU has AMX (`cpublas::could_pack`); elsewhere its tiles
    fall back to a reference GEMM, the reason the prefill kernel exists. Where it does, it
    beats the kernel on long chunks: a real prefill of 8 sessions on a 2-core Xeon with
    AMX took 16.0 s with torch's SDPA against 26.3 s with the kernel at 4k tokens each
    unbounded, 8.6 against 12.5 s bounded, 2.0 against 3.0 s at 1k (medians of 2,
    alternating; docs/results/amx_host.md)."""
    from metronome.model import cpu

    return cpu.amx()


def small_linear(dtype=None):
    """The few-row projection module (`small_linear`) for `dtype` (bf16: on AVX512-BF16
    CPUs; float32: on AVX2 with FMA; None: either), or None where it cannot be built or
    this CPU lacks the instructions (projections then run on oneDNN at every row count)."""
    import torch

    module = SMALL_LINEAR.module()
    if module is None:
        return None
    bf16, f32 = module.available(), module.float32_available()
    usable = {torch.bfloat16: bf16, torch.float32: f32, None: bf16 or f32}.get(dtype, False)
    return module if usable else None


def main() -> int:
    """`python -m metronome.model.native`: build (or find) every kernel; exit 0 either way
    (a machine without a compiler still runs, on the reference ops), but say which."""
    from metronome.model import cpu

    module = kernel()
    if module is None:
        print(f"metronome: {unavailable_reason()}; the engine will use the dense path",
              file=sys.stderr)
    else:
        print(f"metronome: paged-attention kernel ready ({build_dir()})")
    if fused_ops() is None:
        print(f"metronome: {FUSED.reason()}; the model will use torch's elementwise ops",
              file=sys.stderr)
    else:
        print(f"metronome: fused elementwise kernels ready ({FUSED.build_dir()})")
    if prefill_attention() is None:
        why = PREFILL.reason() or cpu.lacks("AVX512-BF16")
        print(f"metronome: prefill attention kernel unavailable ({why}); long chunks use "
              "torch's SDPA", file=sys.stderr)
    elif sdpa_packs_amx_tiles():
        print(f"metronome: prefill attention kernel built ({PREFILL.build_dir()}); long "
              "chunks use torch's SDPA, which runs on this CPU's AMX tiles (faster here)")
    else:
        print(f"metronome: prefill attention kernel ready ({PREFILL.build_dir()})")
    if small_linear() is None:
        why = SMALL_LINEAR.reason() or cpu.lacks("AVX512-BF16 or AVX2 with FMA")
        print(f"metronome: few-row projection kernel unavailable ({why}); projections use "
              "oneDNN", file=sys.stderr)
    else:
        print(f"metronome: few-row projection kernel ready ({SMALL_LINEAR.build_dir()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
