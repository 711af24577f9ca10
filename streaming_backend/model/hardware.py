"""What the hardware is good at: the precision `--dtype auto` picks, and why. Standard library only.

The rule, one pure function (`choose_dtype`) used by the model at load and by the supervisor for
`/status`:

| device | chosen | why |
| --- | --- | --- |
| a GPU with bfloat16 (compute capability 8.0+) | bfloat16 | native bfloat16 matmuls, fp32 range |
| an older GPU | float16 | bfloat16 would be emulated; float16 is native |
| a CPU with AVX512_BF16 or AMX-BF16 | bfloat16 | native bfloat16 dot products: half the bytes |
| any other CPU (AVX2, AVX-512 without BF16, Arm) | float32 | bfloat16 is converted in software |

A CPU whose bfloat16 instructions torch is told not to use (ONEDNN_MAX_CPU_ISA or
ATEN_CPU_CAPABILITY below them: `isa_caps`) counts as one without them.

Measured (docs/design.md): on an AVX2-only EPYC float32 served twice the tokens of bfloat16
at 16 streams and halved TTFT; on an EPYC with AVX512_BF16 bfloat16 matmuls beat float32; on a
Xeon with AVX-512 but no BF16 bfloat16 was no clear win (slower for a 1B model's single row).

`--quantize auto` (`choose_quantize`) picks the compact forward's weight format the same way:

| device and dtype | chosen | why |
| --- | --- | --- |
| a CPU with native bfloat16, model in bfloat16 | int4 | measured faster there, quality held |
| an x86 CPU with AVX2, no native bfloat16, model in float32 or bfloat16 | int4 | measured faster |
| any other CPU or dtype (Arm, float16) | none | unmeasured there |
| a GPU | none | the int4/int8 kernels are CPU kernels |

Measured (docs/performance.md): on an EPYC with AVX512_BF16 int4 served a lone stream 1.7x the
tokens/s of unquantized bfloat16 and 16 streams the same. On the same EPYC told to use nothing
above AVX2 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2`,
under which ATen's int4 kernel runs its AVX2 build) int4 with float32 activations (through
bfloat16 at each quantized matmul) decoded 3.5x float32's tokens/s for one stream and 1.5x at 16.
The quality gate held in both. Every call, prefill too, runs the quantized weights, so one model
answers whatever the load (docs/design.md, "One model whatever the load").
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from streaming_backend.kernels.build import ATEN_BELOW_AVX512  # torch's kernels' cap and ours

AUTO = "auto"
DTYPE_NAMES = ("float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# /proc/cpuinfo flags of CPUs that compute bfloat16 dot products in hardware
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
GPU_BF16_CAPABILITY = 8.0  # Ampere and later
CPUINFO = Path("/proc/cpuinfo")
NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # one folder per GPU the driver sees


@dataclass(frozen=True)
class DtypeChoice:
    """The precision a model loads in, and why (logged at start, shown by `/status`)."""

    setting: str  # what was asked for: auto, or a dtype name or alias
    dtype: str  # one of DTYPE_NAMES
    reason: str

    def as_dict(self) -> dict[str, str]:
        """For JSON (the supervisor's /status)."""
        return {"setting": self.setting, "dtype": self.dtype, "reason": self.reason}


def dtype_name(setting: str) -> str:
    """A dtype name or alias -> its full name; `auto` stays `auto`; anything else ValueError."""
    name = DTYPE_ALIASES.get(setting, setting)
    if name != AUTO and name not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {setting!r}; choose auto, {', '.join(DTYPE_NAMES)}")
    return name


def choose_dtype(
    setting: str,
    device: str,
    cpu_flags: frozenset[str],
    gpu_bf16: bool | None = None,
    capped: frozenset[str] = frozenset(),
) -> DtypeChoice:
    """The dtype for `setting` on `device` ("cpu", "cuda", "cuda:1"): the table above.

    cpu_flags: the CPU's /proc/cpuinfo flags torch may use; gpu_bf16: whether the GPU has
    bfloat16 (None: not known, bfloat16 assumed, as every data-centre GPU since 2020 has it);
    capped: native bfloat16 flags the CPU has but torch is told not to use (`capped_flags`),
    named in the reason.
    """
    name = dtype_name(setting)
    if name != AUTO:
        return DtypeChoice(setting, name, "set explicitly")
    if device.startswith("cuda"):
        if gpu_bf16 is False:
            return DtypeChoice(setting, "float16", "GPU without bfloat16 (compute capability < 8)")
        known = "" if gpu_bf16 else " (assumed: capability not known here)"
        return DtypeChoice(setting, "bfloat16", f"GPU with bfloat16{known}")
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags)
    if native:
        return DtypeChoice(setting, "bfloat16", f"CPU with native bfloat16 ({', '.join(native)})")
    if capped:
        reason = (
            f"CPU without native bfloat16 to use ({', '.join(sorted(capped))} present, but "
            "ONEDNN_MAX_CPU_ISA or ATEN_CPU_CAPABILITY is below it): float32"
        )
        return DtypeChoice(setting, "float32", reason)
    return DtypeChoice(
        setting, "float32", "CPU without native bfloat16 (no avx512_bf16 or amx_bf16): float32"
    )


QUANTIZE_AUTO_KIND = "int4"  # what auto picks where it was measured faster with quality held
INT4_AVX2_DTYPES = ("float32", "bfloat16")  # the model dtypes int4 was measured with on AVX2


@dataclass(frozen=True)
class QuantizeChoice:
    """The compact forward's weight format, and why (logged at load, shown by `/status`)."""

    setting: str  # auto, none, int8 or int4
    kind: str  # none, int8 or int4
    reason: str

    def as_dict(self) -> dict[str, str]:
        """For JSON (the supervisor's /status)."""
        return {"setting": self.setting, "kind": self.kind, "reason": self.reason}


def choose_quantize(
    setting: str, device: str, dtype: str, cpu_flags: frozenset[str]
) -> QuantizeChoice:
    """The weight format for `setting` on `device` with the model in `dtype` (a DTYPE_NAMES
    name): the second table above. An explicit kind is kept as it is (the forward checks it)."""
    if setting != AUTO:
        return QuantizeChoice(setting, setting, "as configured")
    if device.startswith("cuda"):
        return QuantizeChoice(setting, "none", "GPU: the quantized kernels are CPU kernels")
    native = sorted(set(NATIVE_BF16_FLAGS) & cpu_flags)
    if native and dtype == "bfloat16":
        reason = f"CPU with native bfloat16 ({', '.join(native)}), bfloat16 model: measured faster"
        return QuantizeChoice(setting, QUANTIZE_AUTO_KIND, reason)
    if native:
        return QuantizeChoice(setting, "none", f"{dtype} model: int4 measured only with bfloat16")
    if "avx2" in cpu_flags and dtype in INT4_AVX2_DTYPES:
        reason = (
            f"CPU with avx2, without native bfloat16, {dtype} model: measured faster "
            "(on an AVX2 stand-in)"
        )
        return QuantizeChoice(setting, QUANTIZE_AUTO_KIND, reason)
    if "avx2" in cpu_flags:
        return QuantizeChoice(setting, "none", f"{dtype} model: int4 unmeasured with it")
    return QuantizeChoice(setting, "none", "CPU without avx2 or native bfloat16: int4 unmeasured")


def cpu_flags(cpuinfo: Path = CPUINFO, environ: Mapping[str, str] = os.environ) -> frozenset[str]:
    """The first CPU's feature flags (`flags`, or `Features` on Arm); empty when unreadable.

    Without the bfloat16 ones that torch was told not to use (`isa_caps`).
    """
    return all_cpu_flags(cpuinfo) - isa_caps(environ)


def capped_flags(
    cpuinfo: Path = CPUINFO, environ: Mapping[str, str] = os.environ
) -> frozenset[str]:
    """The native bfloat16 flags the CPU has but torch was told not to use (`isa_caps`)."""
    return all_cpu_flags(cpuinfo) & isa_caps(environ)


def all_cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """Every flag of the first CPU in /proc/cpuinfo; empty when unreadable."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


# oneDNN's instruction-set limits (ONEDNN_MAX_CPU_ISA) below its bfloat16 and AMX kernels
ONEDNN_BELOW_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE")
ONEDNN_BELOW_AMX = (*ONEDNN_BELOW_BF16, "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX10_1_512")


def isa_caps(environ: Mapping[str, str]) -> frozenset[str]:
    """The native bfloat16 flags torch is told not to use: ONEDNN_MAX_CPU_ISA (or the older
    DNNL_MAX_CPU_ISA) or ATEN_CPU_CAPABILITY set below them. Such a machine computes bfloat16
    in software, as one without the instructions does (the way to try the AVX2 rules on an
    AVX-512 machine)."""
    onednn = (environ.get("ONEDNN_MAX_CPU_ISA") or environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    aten = environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if onednn in ONEDNN_BELOW_BF16 or aten in ATEN_BELOW_AVX512:
        return frozenset(NATIVE_BF16_FLAGS)
    if onednn in ONEDNN_BELOW_AMX:
        return frozenset({"amx_bf16"})
    return frozenset()


def nvidia_gpu_visible(gpus: Path = NVIDIA_GPUS) -> bool:
    """Whether the NVIDIA driver sees a GPU (without CUDA or torch)."""
    try:
        return any(gpus.iterdir())
    except OSError:
        return False


def gpu_has_bf16() -> bool | None:
    """Whether the first GPU has bfloat16, from nvidia-smi's compute capability; None: unknown."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run(
            [smi, "--query-gpu=compute_cap", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.split()
        return float(out[0]) >= GPU_BF16_CAPABILITY
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def host_quantize(setting: str, dtype: str) -> QuantizeChoice:
    """The supervisor's view of a quantize setting on this host, the models' dtype being `dtype`."""
    device = "cuda" if nvidia_gpu_visible() else "cpu"
    return choose_quantize(setting, device, dtype, cpu_flags())


def host_dtype(setting: str) -> DtypeChoice:
    """The supervisor's view of `setting` on this host, without torch: a model instance whose
    device is auto runs on the first GPU the driver sees, else on the CPU."""
    if nvidia_gpu_visible():
        return choose_dtype(setting, "cuda", cpu_flags(), gpu_has_bf16())
    return choose_dtype(setting, "cpu", cpu_flags(), capped=capped_flags())
