"""What a bench run ran on: CPU, memory, library versions, threads, OpenMP wait policy, load."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def machine(omp_wait_policy: str) -> dict:
    """This machine's facts; `omp_wait_policy` says which policy the measuring process has."""
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model_names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.splitlines()
                   if ln.startswith("model name")]
    flags = next((ln.split(":", 1)[1].split() for ln in cpuinfo.splitlines()
                  if ln.startswith("flags")), [])
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kib = next((int(ln.split()[1]) for ln in meminfo.splitlines()
                    if ln.startswith("MemTotal")), 0)
    import transformers

    return {
        "cpu_model": model_names[0] if model_names else platform.processor(),
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": omp_wait_policy,
        "bf16_isa": [f for f in ("avx512_bf16", "amx_bf16") if f in flags],
        "memory_gib": mem_kib / (1 << 20),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_1m_start": os.getloadavg()[0],
    }
