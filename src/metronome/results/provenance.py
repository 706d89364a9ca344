"""Where a result was measured: the machine, the library versions and the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from metronome.model import cpu
from metronome.model.cpu import cpuinfo_field, proc_lines

# the checkout this package runs from (an installed wheel has none: the commit is then None)
SOURCE_ROOT = Path(__file__).resolve().parents[3]


# what a run writes, not what it runs: a bench regenerating its committed results (the JSON it
# writes as it goes) must not mark its own commit dirty
RESULTS_DIR = "docs/results"


def git_commit(root: Path = SOURCE_ROOT) -> str | None:
    """HEAD's commit hash, with "-dirty" when tracked files other than the results in
    `RESULTS_DIR` differ from it; None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no", "--", ".", f":(exclude){RESULTS_DIR}"],
                               check=True, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "")


def cpu_generation(cpuinfo: list[str]) -> str | None:
    """The CPU's generation as /proc/cpuinfo numbers it ("family F model M"), or None: what
    a VM's generic model name hides (an "AMD EPYC" at family 23 is a Zen 1 or 2, at family
    25 a Zen 3 or 4)."""
    family, model = cpuinfo_field(cpuinfo, "cpu family"), cpuinfo_field(cpuinfo, "model")
    return f"family {family} model {model}" if family and model else None


def vector_isa(flags: list[str]) -> str:
    """The widest SIMD the CPU offers the kernels: avx512f, avx2 (with or without fma)..."""
    if "avx512f" in flags:
        return "avx512f"
    if "avx2" in flags:
        return "avx2+fma" if "fma" in flags else "avx2"
    return next((f for f in ("avx", "sse4_2", "asimd") if f in flags), "none")


def machine() -> dict:
    """This machine's facts: CPU (model, generation, vector ISA), cores, memory, bf16
    instructions, library versions, load."""
    import torch

    cpuinfo = proc_lines("/proc/cpuinfo")
    model_names = [ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")]
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo if ln.startswith("flags")), [])
    mem_kib = next((int(ln.split()[1]) for ln in proc_lines("/proc/meminfo")
                    if ln.startswith("MemTotal")), 0)
    return {
        "cpu_model": model_names[0] if model_names else platform.processor(),
        "cpu_generation": cpu_generation(cpuinfo),
        "vector_isa": vector_isa(flags),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / (1 << 20), 1),
        "bf16_isa": [f for f in ("avx512_bf16", "amx_bf16") if f in flags],
        "cpu_kind": cpu.kind(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m_start": round(os.getloadavg()[0], 2),
    }


def provenance(**facts) -> dict:
    """machine + commit + whatever the run adds (dtype, engine path, model, ...)."""
    return {"commit": git_commit(), "machine": machine()} | facts


def describe(prov: dict) -> str:
    """One markdown line for a report's header: machine, dtype, engine path, commit."""
    m = prov["machine"]
    extra = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in prov.items()
                      if k not in ("commit", "machine") and v is not None)
    facts = ", ".join(str(m[k]) for k in ("cpu_generation", "vector_isa") if m.get(k))
    if m.get("cpu_kind", "native") != "native":
        facts += f", run as a {m['cpu_kind']} host (METRONOME_CPU)"
    return (f"Machine: {m['cpu_model']}{f' ({facts})' if facts else ''}, "
            f"{m['logical_cpus']} logical CPUs, "
            f"{m['memory_gib']} GiB, torch {m['torch']} ({m['torch_threads']} threads)"
            f"{'; ' + extra if extra else ''}; commit `{prov['commit'] or 'unknown'}`.")
