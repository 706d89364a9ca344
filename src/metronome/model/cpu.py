"""What this CPU offers the model: its bf16 instructions, the kernels' compile flags, and what
`--dtype auto` becomes; or what a slower host kind would offer, when one is forced.

Hosts of one machine kind differ: some expose AMX and AVX512-BF16, others neither, and there
the LM runs in float32, the compiled kernels build without their bf16 tasks and torch's SDPA
runs without AMX tiles. `METRONOME_CPU=float32` runs this host as such a one does, so that the
float32 paths (and the wall-clock budgets of the attack suite) are checked here too:

- `avx512_bf16()` and `amx()` say no, so `--dtype auto` resolves to float32 and the model
  takes the paths it takes on that host (`native.sdpa_packs_amx_tiles`, `linear`);
- the kernels are compiled with `-mno-avx512bf16 -mno-amx-*` (into a cache folder of their
  own), so their bf16 tasks are absent exactly as where the CPU lacks the instructions;
- oneDNN is capped below its bf16 and AMX code paths (`ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI`,
  unless set already), so a matmul asked for in bf16 is emulated as it is there. oneDNN reads
  it once, at its first primitive: import this module before any torch work (the tests'
  conftest does; server subprocesses inherit the variable).

What it does not change: the vector width (AVX512F stays, as on a Xeon that hides only
BF16/AMX), CTranslate2's and ONNX Runtime's own dispatch, and vLLM's prebuilt kernels.
`python -m metronome.model.cpu` prints one line: what this host runs (`make test` starts with
it, so a red run says which kind of host it was).
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

ENV = "METRONOME_CPU"
NATIVE, FLOAT32 = "native", "float32"
KINDS = (NATIVE, FLOAT32)
# below oneDNN's AVX512_CORE_BF16 and AVX512_CORE_AMX (a CPU without AVX512 caps lower itself)
ONEDNN_ISA_ENV, ONEDNN_FLOAT32_ISA = "ONEDNN_MAX_CPU_ISA", "AVX512_CORE_VNNI"
# the instructions a float32 host lacks, off for the compiled kernels
FLOAT32_CFLAGS = ("-mno-avx512bf16", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8")


def proc_lines(path: str) -> list[str]:
    """The lines of a /proc file ([] where there is none)."""
    file = Path(path)
    return file.read_text().splitlines() if file.exists() else []


def cpuinfo_field(cpuinfo: list[str], name: str) -> str | None:
    """The first value of a /proc/cpuinfo field (`name` exactly, before the colon)."""
    return next((ln.split(":", 1)[1].strip() for ln in cpuinfo
                 if ":" in ln and ln.split(":", 1)[0].strip() == name), None)


def kind() -> str:
    """`METRONOME_CPU`: "native" (unset: what this CPU offers) or "float32" (as a host without
    AVX512-BF16 or AMX); anything else is refused, naming the choices."""
    value = os.environ.get(ENV, NATIVE).strip().lower() or NATIVE
    if value not in KINDS:
        raise ValueError(f"{ENV} must be one of {', '.join(KINDS)}, got {value!r}")
    return value


def forced() -> bool:
    """Is a slower host kind forced on this one?"""
    return kind() != NATIVE


def avx512_bf16() -> bool:
    """Does the model get AVX512-BF16 here (the CPU has it and no float32 host is forced)?"""
    import torch

    return not forced() and torch.cpu._is_avx512_bf16_supported()


def amx() -> bool:
    """Does the model get AMX tiles here (the CPU has them and no float32 host is forced)?"""
    import torch

    return not forced() and torch.cpu._is_amx_tile_supported()


def native_bf16() -> bool:
    """Does this host compute bf16 matmuls natively (not by conversion)?"""
    return avx512_bf16() or amx()


def lacks(isa: str) -> str:
    """Why the model goes without `isa` (e.g. "AVX512-BF16") here, for messages and skips."""
    return f"{isa} is forced off ({ENV}={kind()})" if forced() else f"this CPU has no {isa}"


def kernel_cflags() -> list[str]:
    """What the compiled kernels add to `-march=native` on this host kind."""
    return list(FLOAT32_CFLAGS) if forced() else []


def _cap_onednn() -> None:
    """(At import. A bad `METRONOME_CPU` is refused where the host kind is first asked for,
    by `kind()`, not here.)"""
    if os.environ.get(ENV, NATIVE).strip().lower() == FLOAT32:
        os.environ.setdefault(ONEDNN_ISA_ENV, ONEDNN_FLOAT32_ISA)


def describe() -> str:
    """One line: the CPU, its bf16 instructions as the model gets them, the kernels' vector
    paths and what `--dtype auto` resolves to."""
    import torch

    cpuinfo = proc_lines("/proc/cpuinfo")
    flags = set((cpuinfo_field(cpuinfo, "flags") or "").split())
    name = cpuinfo_field(cpuinfo, "model name") or platform.processor() or "unknown CPU"
    generation = (f"family {cpuinfo_field(cpuinfo, 'cpu family')} model "
                  f"{cpuinfo_field(cpuinfo, 'model')}")

    def offered(has: bool, flag: str) -> str:
        if has:
            return "yes"
        return f"forced off by {ENV}={kind()}" if flag in flags else "no"

    simd = "AVX512F" if "avx512f" in flags else "AVX2+FMA" if {"avx2", "fma"} <= flags else (
        "no AVX2+FMA: the kernels' vector tasks are absent")
    dtype = "bfloat16" if native_bf16() else "float32"
    onednn = os.environ.get(ONEDNN_ISA_ENV)
    return (f"host: {name} ({generation}), {os.cpu_count()} CPUs, {simd}; AVX512-BF16 "
            f"{offered(avx512_bf16(), 'avx512_bf16')}, AMX {offered(amx(), 'amx_tile')}; "
            f"--dtype auto -> {dtype}; kernels' bf16 tasks "
            f"{'built' if avx512_bf16() else 'absent'}"
            f"{f'; {ONEDNN_ISA_ENV}={onednn}' if onednn else ''}; torch {torch.__version__}")


_cap_onednn()


def main() -> int:
    try:
        print(f"metronome: {describe()}")
    except ValueError as err:
        print(f"metronome: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
