"""The precision `--dtype auto` and the weights `--quantize auto` pick, from faked CPU flags and
GPUs, and reading the flags."""

import pytest

from streaming_backend.model import hardware
from streaming_backend.model.hardware import choose_dtype, choose_quantize

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}
ARM = frozenset({"fp", "asimd", "sve"})


@pytest.mark.parametrize(
    "setting, device, flags, gpu_bf16, dtype, reason",
    [
        ("auto", "cpu", AVX2, None, "float32", "without native bfloat16"),
        ("auto", "cpu", AVX512, None, "float32", "without native bfloat16"),
        ("auto", "cpu", ARM, None, "float32", "without native bfloat16"),
        ("auto", "cpu", frozenset(), None, "float32", "without native bfloat16"),
        ("auto", "cpu", AVX512_BF16, None, "bfloat16", "native bfloat16 (avx512_bf16)"),
        ("auto", "cpu", AMX, None, "bfloat16", "native bfloat16 (amx_bf16)"),
        ("auto", "cuda", AVX2, True, "bfloat16", "GPU with bfloat16"),
        ("auto", "cuda:1", AVX2, True, "bfloat16", "GPU with bfloat16"),
        ("auto", "cuda", AVX2, False, "float16", "GPU without bfloat16"),
        ("auto", "cuda", AVX2, None, "bfloat16", "assumed"),
        ("bf16", "cpu", AVX2, None, "bfloat16", "set explicitly"),
        ("float32", "cpu", AVX512_BF16, None, "float32", "set explicitly"),
        ("fp16", "cuda", AVX2, True, "float16", "set explicitly"),
        ("half", "cpu", AVX2, None, "float16", "set explicitly"),
    ],
)
def test_dtype_rule(setting, device, flags, gpu_bf16, dtype, reason):
    """bfloat16 where the hardware computes it natively, float32 on other CPUs, float16 on
    older GPUs; an explicit dtype is kept. The reason says which case applied."""
    choice = choose_dtype(setting, device, flags, gpu_bf16)
    assert choice.dtype == dtype
    assert reason in choice.reason
    assert choice.as_dict() == {"setting": setting, "dtype": dtype, "reason": choice.reason}


@pytest.mark.parametrize(
    "setting, device, dtype, flags, kind, reason",
    [
        ("auto", "cpu", "bfloat16", AVX512_BF16, "int4", "native bfloat16 (avx512_bf16)"),
        ("auto", "cpu", "bfloat16", AMX, "int4", "native bfloat16 (amx_bf16)"),
        ("auto", "cpu", "float32", AVX512_BF16, "none", "float32 model"),
        ("auto", "cpu", "float32", AVX2, "int4", "avx2, without native bfloat16, float32"),
        ("auto", "cpu", "bfloat16", AVX2, "int4", "avx2, without native bfloat16, bfloat16"),
        ("auto", "cpu", "float32", AVX512, "int4", "avx2, without native bfloat16"),
        ("auto", "cpu", "float16", AVX2, "none", "float16 model: int4 unmeasured"),
        ("auto", "cpu", "float32", ARM, "none", "without avx2 or native bfloat16"),
        ("auto", "cpu", "float32", frozenset(), "none", "without avx2 or native bfloat16"),
        ("auto", "cuda", "bfloat16", AVX512_BF16, "none", "CPU kernels"),
        ("int8", "cpu", "float32", AVX2, "int8", "as configured"),
        ("none", "cpu", "bfloat16", AVX512_BF16, "none", "as configured"),
    ],
)
def test_quantize_rule(setting, device, dtype, flags, kind, reason):
    """int4 only where it was measured faster (a CPU with native bfloat16, the model in
    bfloat16; an x86 CPU with AVX2 without it, the model in float32 or bfloat16), none
    elsewhere; an explicit kind is kept. The reason says which case applied."""
    choice = choose_quantize(setting, device, dtype, flags)
    assert (choice.kind, choice.setting) == (kind, setting)
    assert reason in choice.reason
    assert choice.as_dict() == {"setting": setting, "kind": kind, "reason": choice.reason}


def test_host_quantize_follows_the_dtype_and_the_gpu(monkeypatch):
    """The supervisor's view: the CPU rule on this machine's flags, none with a GPU."""
    monkeypatch.setattr(hardware, "nvidia_gpu_visible", lambda: False)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: AVX512_BF16)
    assert hardware.host_quantize("auto", "bfloat16").kind == "int4"
    assert hardware.host_quantize("auto", "float32").kind == "none"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: AVX2)
    assert hardware.host_quantize("auto", "float32").kind == "int4"
    monkeypatch.setattr(hardware, "nvidia_gpu_visible", lambda: True)
    assert hardware.host_quantize("auto", "bfloat16").kind == "none"


def test_a_capped_cpu_says_why_it_gets_float32(tmp_path):
    """A CPU with avx512_bf16 that torch is told not to use gets float32, and the reason names
    the flag and the cap rather than claiming the CPU lacks it."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t: avx2 avx512f avx512_bf16\n")
    environ = {"ONEDNN_MAX_CPU_ISA": "AVX2"}
    flags = hardware.cpu_flags(cpuinfo, environ)
    capped = hardware.capped_flags(cpuinfo, environ)
    assert capped == {"avx512_bf16"} and "avx512_bf16" not in flags
    choice = choose_dtype("auto", "cpu", flags, capped=capped)
    assert choice.dtype == "float32"
    assert "avx512_bf16 present, but ONEDNN_MAX_CPU_ISA or ATEN_CPU_CAPABILITY" in choice.reason
    assert hardware.capped_flags(cpuinfo, {}) == frozenset()
    assert choose_quantize("auto", "cpu", "float32", flags).kind == "int4"  # avx2 is left


def test_unknown_dtype_is_refused_with_the_choices():
    """A dtype we do not know is refused, naming the ones we do."""
    with pytest.raises(ValueError, match="unknown dtype 'int8'; choose auto, float32"):
        choose_dtype("int8", "cpu", AVX2)


def test_cpu_flags_from_cpuinfo(tmp_path):
    """x86 `flags` and Arm `Features` lines are read; a missing file means no flags."""
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nflags\t: other\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd\n")
    assert hardware.cpu_flags(x86, {}) == {"fpu", "avx2", "avx512_bf16"}
    assert hardware.cpu_flags(arm, {}) == {"fp", "asimd"}
    assert hardware.cpu_flags(tmp_path / "missing") == frozenset()


@pytest.mark.parametrize(
    "environ, left",
    [
        ({}, {"avx2", "avx512_bf16", "amx_bf16"}),
        ({"ONEDNN_MAX_CPU_ISA": "AVX2"}, {"avx2"}),
        ({"DNNL_MAX_CPU_ISA": "avx512_core"}, {"avx2"}),
        ({"ATEN_CPU_CAPABILITY": "avx2"}, {"avx2"}),
        ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}, {"avx2", "avx512_bf16"}),
        ({"ONEDNN_MAX_CPU_ISA": "ALL", "ATEN_CPU_CAPABILITY": "avx512"}, None),
    ],
)
def test_bf16_flags_torch_may_not_use_are_dropped(tmp_path, environ, left):
    """An instruction-set limit given to oneDNN or ATen below bfloat16 (or AMX) drops those
    flags, so `auto` chooses as on a CPU without them."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("flags\t: avx2 avx512_bf16 amx_bf16\n")
    left = left or {"avx2", "avx512_bf16", "amx_bf16"}
    flags = hardware.cpu_flags(cpuinfo, environ)
    assert flags == left
    assert choose_dtype("auto", "cpu", flags).dtype == (
        "bfloat16" if "avx512_bf16" in left else "float32"
    )


def test_this_machines_flags_are_read():
    """On Linux the running CPU's flags are found (the rule is never fed an empty set here)."""
    if not hardware.CPUINFO.is_file():
        pytest.skip("no /proc/cpuinfo")
    assert hardware.cpu_flags()


def test_gpu_visibility(tmp_path):
    """A GPU is visible when the driver lists one; an empty or missing folder means none."""
    assert not hardware.nvidia_gpu_visible(tmp_path / "missing")
    assert not hardware.nvidia_gpu_visible(tmp_path)
    (tmp_path / "0000:01:00.0").mkdir()
    assert hardware.nvidia_gpu_visible(tmp_path)


def test_host_dtype_uses_the_cpu_rule_without_a_gpu(monkeypatch):
    """The supervisor's view: no GPU -> the CPU rule on this machine's flags."""
    monkeypatch.setattr(hardware, "nvidia_gpu_visible", lambda: False)
    monkeypatch.setattr(hardware, "cpu_flags", lambda: AVX2)
    assert hardware.host_dtype("auto").dtype == "float32"
    monkeypatch.setattr(hardware, "cpu_flags", lambda: AVX512_BF16)
    assert hardware.host_dtype("auto").dtype == "bfloat16"


def test_host_dtype_asks_the_gpu(monkeypatch):
    """With a GPU visible the GPU rule applies, with its bfloat16 support as nvidia-smi says."""
    monkeypatch.setattr(hardware, "nvidia_gpu_visible", lambda: True)
    monkeypatch.setattr(hardware, "gpu_has_bf16", lambda: False)
    assert hardware.host_dtype("auto").dtype == "float16"
