"""Where a result was measured: the machine, the library versions and the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

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


def _proc_lines(path: str) -> list[str]:
    file = Path(path)
    return file.read_text().splitlines() if file.exists() else []


def machine() -> dict:
    """This machine's facts: CPU, cores, memory, bf16 instructions, library versions, load."""
    import torch

    cpuinfo = _proc_lines("/proc/cpuinfo")
    model_names = [ln.split(":", 1)[1].strip() for ln in cpuinfo if ln.startswith("model name")]
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo if ln.startswith("flags")), [])
    mem_kib = next((int(ln.split()[1]) for ln in _proc_lines("/proc/meminfo")
                    if ln.startswith("MemTotal")), 0)
    return {
        "cpu_model": model_names[0] if model_names else platform.processor(),
        "logical_cpus": os.cpu_count(),
        "memory_gib": round(mem_kib / (1 << 20), 1),
        "bf16_isa": [f for f in ("avx512_bf16", "amx_bf16") if f in flags],
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
    return (f"Machine: {m['cpu_model']}, {m['logical_cpus']} logical CPUs, "
            f"{m['memory_gib']} GiB, torch {m['torch']} ({m['torch_threads']} threads)"
            f"{'; ' + extra if extra else ''}; commit `{prov['commit'] or 'unknown'}`.")
