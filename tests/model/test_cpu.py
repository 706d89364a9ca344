"""`METRONOME_CPU`: a float32 host forced on this one takes the paths such a host takes (no
bf16 dtype by default, kernels without their bf16 tasks, torch's SDPA without AMX), whatever
this CPU offers; a bad value is refused naming the choices."""

from __future__ import annotations

import pytest
import torch

from metronome.model import cpu, native
from metronome.model.dtypes import resolve_dtype


@pytest.fixture
def bf16_cpu(monkeypatch):
    """This CPU, as if it had AVX512-BF16 and AMX (so a forced host is seen to hide them)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)


def test_native_takes_what_the_cpu_offers(bf16_cpu, monkeypatch):
    monkeypatch.delenv(cpu.ENV, raising=False)
    assert cpu.kind() == "native" and not cpu.forced()
    assert cpu.avx512_bf16() and cpu.amx() and native.sdpa_packs_amx_tiles()
    assert resolve_dtype("auto") == torch.bfloat16
    assert cpu.kernel_cflags() == []
    assert "AVX512-BF16 yes, AMX yes; --dtype auto -> bfloat16" in cpu.describe()


def test_a_forced_float32_host_hides_bf16_and_amx(bf16_cpu, monkeypatch):
    monkeypatch.setenv(cpu.ENV, "float32")
    assert cpu.forced()
    assert not cpu.avx512_bf16() and not cpu.amx() and not native.sdpa_packs_amx_tiles()
    assert resolve_dtype("auto") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16  # asked for by name, it is served
    assert set(cpu.kernel_cflags()) >= {"-mno-avx512bf16", "-mno-amx-tile"}
    assert "--dtype auto -> float32; kernels' bf16 tasks absent" in cpu.describe()
    assert cpu.lacks("AVX512-BF16") == "AVX512-BF16 is forced off (METRONOME_CPU=float32)"


def test_the_kernels_of_a_forced_host_build_apart(monkeypatch):
    """A forced host's kernels are another build (no bf16 tasks): never the native cache."""
    monkeypatch.delenv(cpu.ENV, raising=False)
    native_dir = native.PAGED.build_dir()
    monkeypatch.setenv(cpu.ENV, "float32")
    assert native.PAGED.build_dir() != native_dir


def test_a_bad_value_is_refused_with_the_choices(monkeypatch):
    monkeypatch.setenv(cpu.ENV, "bf16")
    with pytest.raises(ValueError, match="METRONOME_CPU must be one of native, float32"):
        cpu.kind()
    with pytest.raises(ValueError, match="got 'bf16'"):
        resolve_dtype("auto")
