"""GPUs by name: the total memory the engine sees on a card, and the one place `--gpu` /
`--gpu-memory` (`hardware.gpu` / `hardware.gpu_memory`) become the bytes the ledger sizes from.

The figure is CUDA's total for the card, not its marketing size and not nvidia-smi's memory.total:
vLLM 0.33.0 requests `ceil(total_device_memory * gpu_memory_utilization)`
(`vllm/v1/worker/utils.py::request_memory`), the total of `torch.cuda.mem_get_info()` (as in
https://github.com/vllm-project/vllm/pull/10511: `free_memory_pre_profile, total_gpu_memory =
torch.cuda.mem_get_info()`),
which is the device's `totalGlobalMem` that torch prints as `total_memory` and CUDA's deviceQuery
prints in bytes. nvidia-smi's memory.total is larger by the driver's reserved memory, 350-760 MiB
on the cards below and different per card and driver (H100 SXM 81559 MiB vs 81106 MiB, A100 80GB
81920 vs 81158, RTX 4090 24564 vs 24210: the `_smi.py` files beside each deviceQuery source), so
no rule turns one into the other and only CUDA's figure is listed. It moves by a few MiB between
driver releases, so a pool sized from it is good to well under 0.1%. SGLang 0.5.23 picks its default
mem_fraction_static from nvidia-smi's memory.total (`sglang/srt/utils/common.py::get_nvgpu_memory_capacity`);
the ledger reads the CUDA figure there too, a difference of 0.001 in that fraction on an H100.
For a card not listed, give `--gpu-memory NMiB` with the N torch prints as `total_memory=NMB`
(`torch.cuda.get_device_properties(0)`; its MB are MiB).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote

from kvprobe.errors import ConfigError
from kvprobe.units import describe_memory_size, format_bytes, parse_memory_size

_DQ = "https://github.com/thamada/nvidia-smi/blob/c4c8a463a61e4ac67e3d7956da104b302760a498/gls/"


@dataclass(frozen=True)
class Gpu:
    name: str  # kvprobe's name for the card (the form `--gpu` and `hardware.gpu` print)
    smi_name: str  # the name nvidia-smi and torch print
    total_bytes: int  # CUDA's total (deviceQuery "Total amount of global memory", bytes)
    source: str  # where the figure was read
    # the family the ledger's kernel-padding rules know (theory/model/mxfp4.py GPU_ARCHS): the card's
    # compute capability, 9.0 Hopper "sm90", 8.9 Ada "sm89"; None where no rule is read (Ampere, RTX 5090's
    # sm120): the ledger's default then holds
    arch: str | None = None
    # the compute capability, "major.minor", as the source prints it (deviceQuery's "CUDA Capability Major/Minor
    # version number", torch's major=, minor=): vLLM picks kernels by it (a GDN layer's prefill kernel,
    # theory/vllm/hybrid/kv_cache_spec.py resolve_gdn_prefill_backend)
    capability: str | None = None
    # streaming multiprocessors (deviceQuery "(N) Multiprocessors"), where the card's source prints them: vLLM's
    # triton top-k/top-p kernel keeps one vocab row per SM it launches (theory/vllm/memory_profile.py)
    sms: int | None = None


# Cards whose figure is torch's `_CudaDeviceProperties(..., total_memory=NMB, ...)` repr, pasted in
# public code: torch prints total_memory // 2**20 (MiB), so the bytes are N MiB, low by under 1 MiB
# (0.001% of a pool). The code search that found these lines named no repository, so each row links
# GitHub's code search for the exact repr it quotes.


def _torch_repr(line: str) -> str:
    return "https://github.com/search?type=code&q=" + quote(f'"{line}"')

# Each row: deviceQuery's "Total amount of global memory: N MBytes (B bytes)" on that card, and its "CUDA Capability
# Major/Minor version number" (torch's repr: major=, minor=).
GPUS = (
    # H100 SXM, driver 565.57.01 / CUDA 12.7: 81106 MBytes (85045477376 bytes)
    Gpu("H100-80GB", "NVIDIA H100 80GB HBM3", 85045477376, _DQ + "H100SXMx8_deviceQuery.py", arch="sm90",
        capability="9.0"),
    # H100 PCIe: "_CudaDeviceProperties(name='NVIDIA H100 PCIe', major=9, minor=0, total_memory=81008MB,
    # multi_processor_count=114)"
    Gpu("H100-PCIe", "NVIDIA H100 PCIe", 81008 * 2**20,
        _torch_repr("name='NVIDIA H100 PCIe', major=9, minor=0, total_memory=81008MB"), arch="sm90", capability="9.0"),
    # H200 (SXM, 141 GB HBM3e): "_CudaDeviceProperties(name='NVIDIA H200', major=9, minor=0,
    # total_memory=143156MB, multi_processor_count=132, ...)"
    Gpu("H200", "NVIDIA H200", 143156 * 2**20,
        _torch_repr("name='NVIDIA H200', major=9, minor=0, total_memory=143156MB"), arch="sm90", capability="9.0"),
    # H20 (96 GB HBM3): "_CudaDeviceProperties(name='NVIDIA H20', major=9, minor=0, total_memory=97285MB,
    # multi_processor_count=78)"
    Gpu("H20", "NVIDIA H20", 97285 * 2**20,
        _torch_repr("name='NVIDIA H20', major=9, minor=0, total_memory=97285MB"), arch="sm90", capability="9.0"),
    # H100 NVL, driver 550.54.14: 95235 MBytes (99861594112 bytes)
    Gpu("H100-NVL", "NVIDIA H100 NVL", 99861594112, _DQ + "H100NVLx2_deviceQuery.py", arch="sm90", capability="9.0"),
    # A100 SXM4 80GB, driver 555.42.02: 81158 MBytes (85100068864 bytes)
    Gpu("A100-80GB", "NVIDIA A100-SXM4-80GB", 85100068864, _DQ + "A100SXMx4_deviceQuery.py", capability="8.0"),
    # A100 SXM4 40GB, CUDA 12.2: 40339 MBytes (42298834944 bytes), a deviceQuery pasted in the PR
    Gpu("A100-40GB", "NVIDIA A100-SXM4-40GB", 42298834944, "https://github.com/bottlerocket-os/bottlerocket/pull/3873",
        capability="8.0"),
    # L40S, driver 550.127.05: 45589 MBytes (47803596800 bytes)
    Gpu("L40S", "NVIDIA L40S", 47803596800, _DQ + "L40S_deviceQuery.py", arch="sm89", capability="8.9"),
    # A40, driver 550.127.05: 45403 MBytes (47608692736 bytes)
    Gpu("A40", "NVIDIA A40", 47608692736, _DQ + "A40x10_deviceQuery.py", capability="8.6"),
    # L4, driver 550.90.07: 22478 MBytes (23570219008 bytes)
    Gpu("L4", "NVIDIA L4", 23570219008, _DQ + "L4_deviceQuery.py", arch="sm89", capability="8.9"),
    # A10, CUDA 12.2: 21.99 GBytes (23609475072 bytes), a device query in the README
    Gpu("A10", "NVIDIA A10", 23609475072,
        "https://github.com/aalanwyr/face2cuda/blob/9ad81566c5da19bc4950596a37d3820a595b280a/step2cuda/README.md",
        capability="8.6"),
    # A10G (AWS g5, 24 GB GDDR6): "_CudaDeviceProperties(name='NVIDIA A10G', major=8, minor=6,
    # total_memory=22587MB, multi_processor_count=80, ...)", torch 2.15 / CUDA 13.0
    Gpu("A10G", "NVIDIA A10G", 22587 * 2**20,
        _torch_repr("name='NVIDIA A10G', major=8, minor=6, total_memory=22587MB"), capability="8.6"),
    # RTX 6000 Ada, CUDA 12.4: 48640 MBytes (51002867712 bytes)
    Gpu("RTX-6000-Ada", "NVIDIA RTX 6000 Ada Generation", 51002867712, _DQ + "RTX6000Ada_x8_deviceQuery.py",
        arch="sm89", capability="8.9"),
    # GeForce RTX 3090, driver 560.35.03: 24154 MBytes (25327697920 bytes); "(082) Multiprocessors"
    Gpu("RTX-3090", "NVIDIA GeForce RTX 3090", 25327697920, _DQ + "RTX3090_deviceQuery.py", sms=82, capability="8.6"),
    # GeForce RTX 4090, driver 550.127.05: 24210 MBytes (25386352640 bytes)
    Gpu("RTX-4090", "NVIDIA GeForce RTX 4090", 25386352640, _DQ + "RTX4090_deviceQuery.py", arch="sm89",
        capability="8.9"),
    # GeForce RTX 5090, driver 570.133.04 / CUDA 12.8: 32117 MBytes (33677180928 bytes), deviceQuery in the issue
    Gpu("RTX-5090", "NVIDIA GeForce RTX 5090", 33677180928,
        "https://github.com/aikitoria/open-gpu-kernel-modules/issues/1", capability="12.0"),
)
# Other spellings of a listed card (the interface, the marketing name).
_ALIASES = {"H100-SXM": "H100-80GB", "H100": "H100-80GB", "A100-SXM4-80GB": "A100-80GB",
            "A100-SXM4-40GB": "A100-40GB", "H200-SXM": "H200", "H200-141GB": "H200", "H20-96GB": "H20"}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower().removeprefix("nvidia").replace("geforce", ""))


_BY_KEY = {**{_key(g.name): g for g in GPUS}, **{_key(g.smi_name): g for g in GPUS}}
_BY_KEY.update({_key(alias): _BY_KEY[_key(name)] for alias, name in _ALIASES.items()})


def arch_of(name: str | None) -> str | None:
    """The GPU family of the card `name` names, for the ledger's `gpu_arch` (None: not known)."""
    return None if name is None else find_gpu(name, key="gpu").arch


def sms_of(name: str | None) -> int | None:
    """The SM count of the card `name` names, for the ledger's `gpu_sms` (None: not listed)."""
    return None if name is None else find_gpu(name, key="gpu").sms


def known_names() -> list[str]:
    return [g.name for g in GPUS]


def find_gpu(name: str, *, key: str) -> Gpu:
    """The card `name` names (kvprobe's name, an alias or nvidia-smi's, any case), or an error listing them."""
    gpu = _BY_KEY.get(_key(str(name)))
    if gpu is None:
        raise ConfigError(f"unknown GPU {name!r}: known GPUs are {', '.join(known_names())} (another card: "
                          "give its memory instead, as torch reports it, e.g. --gpu-memory 81106MiB)", key=key)
    return gpu


@dataclass(frozen=True)
class GpuMemory:
    """What the faces read: the bytes, and how to say where they came from."""

    total_bytes: int
    said: str  # "GPU memory 80 GB = 74.51 GiB as written" / "GPU H100-80GB (...): memory 79.20 GiB as CUDA ..."
    gpu: Gpu | None = None


MIN_GPU_MEMORY = 2**30  # a GPU of less than 1 GiB is a unit mistake, not a card


def gpu_memory(*, gpu: str | None, memory: str | int | None, gpu_key: str = "--gpu",
               memory_key: str = "--gpu-memory", file: str | None = None) -> GpuMemory | None:
    """`--gpu NAME` or `--gpu-memory SIZE` (one of them, or neither) -> the memory of one GPU; an
    expectation's `hardware.gpu` / `hardware.gpu_memory` the same way, its errors naming `file`."""
    try:
        return _gpu_memory(gpu, memory, gpu_key, memory_key)
    except ConfigError as err:
        if file is None:
            raise
        raise ConfigError(str(err), file=file) from None


def _gpu_memory(gpu, memory, gpu_key: str, memory_key: str) -> GpuMemory | None:
    if gpu is not None and memory is not None:
        raise ConfigError(f"one of {gpu_key} or {memory_key}, not both ({gpu_key} {gpu} already says the card's "
                          "memory)", key=gpu_key)
    if gpu is not None:
        card = find_gpu(gpu, key=gpu_key)
        return GpuMemory(card.total_bytes, f"GPU {card.name} ({card.smi_name}): memory "
                                           f"{format_bytes(card.total_bytes)} as CUDA reports the card", card)
    if memory is None:
        return None
    size = parse_memory_size(memory, key=memory_key)
    if size < MIN_GPU_MEMORY:
        raise ConfigError(f"{str(memory).strip()!r} is less than 1 GiB: write the memory of one GPU, e.g. 24GiB or "
                          "80GB", key=memory_key)
    return GpuMemory(size, f"GPU memory {describe_memory_size(str(memory), size)}")


def gpu_free_memory(memory: str | int | None, *, total: GpuMemory | None, key: str = "--gpu-free-memory",
                    file: str | None = None) -> int | None:
    """`--gpu-free-memory SIZE` (`hardware.gpu_free_memory`): what a shared card had free when the engine
    started, in the units `--gpu-memory` takes. SGLang takes its defaults from the total and its pool from this
    (kvprobe/theory/sglang/budget.py sglang_free_at_start). Refused naming `key`: without a total, or above it."""
    if memory is None:
        return None
    try:
        size = parse_memory_size(memory, key=key)
        if total is None:
            raise ConfigError("the card's total too (--gpu NAME or --gpu-memory SIZE; hardware.gpu / gpu_memory): "
                              "SGLang takes its defaults from the total and its pool from the free memory", key=key)
        if size > total.total_bytes:
            raise ConfigError(f"a free memory at most the card's total {format_bytes(total.total_bytes)}, got "
                              f"{describe_memory_size(str(memory), size)}", key=key)
    except ConfigError as err:
        if file is None:
            raise
        raise ConfigError(str(err), file=file) from None
    return size
