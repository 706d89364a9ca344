"""The compiled paged-attention kernel (`csrc/paged_attention.cpp`): built on first use, cached.

`kernel()` returns the loaded extension, or None when it cannot be built here (no C++
compiler, no ninja): then `unavailable_reason()` says why and the engine runs the dense
reference path (`metronome.model.llama`), which gives the same results. `make install`
builds it once (`python -m metronome.model.native`) so the first session does not wait
for the compiler (~1 min on 2 cores).

The build is specific to this CPU (`-march=native`) and this venv's torch: its cache folder
is named after a hash of the CPU's model and flags, the venv and the torch version, so a
cache shared with another machine or venv is never reused.
Set METRONOME_NATIVE_ATTENTION=0 to never build or load it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.cpp"
DISABLE_ENV = "METRONOME_NATIVE_ATTENTION"
# -ffast-math lets GCC use glibc's vector expf in the softmax loop; the kernel uses no
# infinities or NaNs (a finite sentinel masks). Compile flags only: linking a shared object
# with -ffast-math could flip the process's denormal mode.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_tag() -> str:
    """Hash of what the build depends on: this CPU (model, flags), this Python environment
    (its torch headers and ABI) and the torch version."""
    import torch

    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = platform.processor()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    text = "\n".join(sorted(set(lines)) + [platform.machine(), sys.prefix, torch.__version__])
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def build_dir() -> Path:
    from metronome.model.weights import cache_dir

    return cache_dir() / "native" / f"paged_attention_{_cpu_tag()}"


def kernel():
    """The extension module (its `paged_attention` function), or None if it cannot be built."""
    with _lock:
        if "module" not in _state:
            _state["module"], _state["reason"] = _load()
        return _state["module"]


def unavailable_reason() -> str | None:
    """Why `kernel()` is None (None when it loaded, or before the first `kernel()` call)."""
    return _state.get("reason")  # type: ignore[return-value]


def _load():
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None, f"disabled by {DISABLE_ENV}=0"
    try:
        import torch.utils.cpp_extension as cpp
    except ImportError as err:  # pragma: no cover - torch always ships it
        return None, f"torch.utils.cpp_extension unavailable: {err}"
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    fresh = not any(directory.glob("*.so"))
    if fresh:
        print(f"metronome: compiling the paged-attention kernel into {directory} "
              "(first use on this machine, about a minute)...", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        module = cpp.load(name=f"metronome_paged_attention_{_cpu_tag()}", sources=[str(SOURCE)],
                          extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                          build_directory=str(directory), verbose=False)
    except (RuntimeError, OSError, ImportError, SystemExit) as err:
        reason = f"the paged-attention kernel could not be built ({type(err).__name__}: " \
                 f"{str(err).strip().splitlines()[-1] if str(err).strip() else err!r}); " \
                 "a C++ compiler (g++) and the ninja package are needed"
        log.warning("%s; using the dense attention path (same results, slower)", reason)
        return None, reason
    if fresh:
        print(f"metronome: paged-attention kernel built in {time.perf_counter() - started:.0f} s",
              file=sys.stderr, flush=True)
    return module, None


def main() -> int:
    """`python -m metronome.model.native`: build (or find) the kernel; exit 0 either way
    (a machine without a compiler still runs, on the dense path), but say which."""
    module = kernel()
    if module is None:
        print(f"metronome: {unavailable_reason()}; the engine will use the dense path",
              file=sys.stderr)
    else:
        print(f"metronome: paged-attention kernel ready ({build_dir()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
