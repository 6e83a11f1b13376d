"""experiments/environment.py: the CPU named closely enough to tell two machines apart (issue 44: the same
random-init cell gave 0.314 and 0.318 Dice on two machines whose model name was the same "AMD EPYC")."""

from __future__ import annotations

import platform

import pytest

from fedssl.experiments import environment as env_mod

TWO_PROCESSORS = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
                  "model name\t: Intel(R) Xeon(R) Platinum 8480+\nstepping\t: 8\n"
                  "flags\t\t: fpu sse avx2 avx512f amx_tile avx512_bf16 fma\n\n"
                  "processor\t: 1\nvendor_id\t: OtherVendor\ncpu family\t: 25\nmodel\t\t: 1\nstepping\t: 0\n"
                  "flags\t\t: fpu avx\n")
ARM = "processor\t: 0\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd40\nCPU revision\t: 1\n"


def test_cpu_id_is_the_first_processors_vendor_family_model_and_stepping(tmp_path):
    (tmp_path / "x86").write_text(TWO_PROCESSORS)
    (tmp_path / "arm").write_text(ARM)
    assert env_mod.cpu_id(str(tmp_path / "x86")) == "GenuineIntel family 6 model 143 stepping 8"
    assert env_mod.cpu_id(str(tmp_path / "arm")) == "implementer 0x41 part 0xd40 revision 1"
    assert env_mod.cpu_id(str(tmp_path / "none")) == "unknown"


def test_vector_extensions_in_a_fixed_order(tmp_path):
    (tmp_path / "x86").write_text(TWO_PROCESSORS)
    (tmp_path / "arm").write_text(ARM)
    assert env_mod.vector_extensions(str(tmp_path / "x86")) == ["avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]
    assert env_mod.vector_extensions(str(tmp_path / "arm")) == ["asimd", "sve"]
    assert env_mod.vector_extensions(str(tmp_path / "none")) == []


def test_onednn_isa_is_read_from_its_verbose_header():
    text = ("onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71)\n"
            "onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:2\n"
            "onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with Intel DL Boost and bfloat16 support\n"
            "onednn_verbose,v1,info,gpu,runtime:none\n")
    assert env_mod.parse_onednn_isa(text) == "Intel AVX-512 with Intel DL Boost and bfloat16 support"
    assert env_mod.parse_onednn_isa("dnnl_verbose,info,cpu,isa:Intel AVX2\n") == "Intel AVX2"
    assert env_mod.parse_onednn_isa("dnnl_verbose,info,gpu,runtime:none\n") == "unknown"


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or "avx2" not in env_mod.vector_extensions(),
                    reason="oneDNN's AVX2 cap needs an x86 CPU with AVX2")
def test_onednn_isa_follows_the_cap_this_process_sets(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    uncapped = env_mod.onednn_isa()
    assert uncapped.startswith("Intel AVX")  # oneDNN names x86 instruction sets so, on AMD CPUs too
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert env_mod.onednn_isa() == "Intel AVX2"
    if "avx512f" in env_mod.vector_extensions():
        assert uncapped != "Intel AVX2"  # each cap is probed apart, not the first answer reused
    assert env_mod.thread_variables()["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    env = env_mod.environment()
    assert env["onednn_isa"] == "Intel AVX2" and env["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["cpu_id"] == env_mod.cpu_id() and env["vector"] == env_mod.vector_extensions()


def test_instruction_set_caps_are_recorded_beside_the_thread_variables():
    environ = {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2", "OMP_NUM_THREADS": "1", "HOME": "/x"}
    assert env_mod.thread_variables(environ) == {"ATEN_CPU_CAPABILITY": "avx2", "DNNL_MAX_CPU_ISA": "AVX2",
                                                 "OMP_NUM_THREADS": "1"}
