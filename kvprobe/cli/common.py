"""What the console's subcommands share: the GPU options, and an argument parser whose errors
put the one useful line first."""

from __future__ import annotations

import argparse
import sys


class Parser(argparse.ArgumentParser):
    """argparse, except that a usage error is `kvprobe probe: error: ...` and a one-line hint,
    not the whole usage first (the help is one flag away)."""

    def error(self, message: str):  # noqa: D401 - argparse's signature
        print(f"{self.prog}: error: {message}\n({self.prog} --help for the options)", file=sys.stderr)
        raise SystemExit(2)


GPU_HELP = ("the card the engine runs on, by name (H100-80GB, A100-80GB, L40S, L4, RTX-4090, ...): its total "
            "memory as CUDA reports it; instead of --gpu-memory")
GPU_MEMORY_HELP = ("the memory of one GPU, with its unit: 79.2GiB / 81106MiB (binary) or 85GB (decimal); "
                   "a bare number or 80G is refused")

GPU_FREE_MEMORY_HELP = ("a shared card: the memory free when the engine starts (another process holds the rest), "
                        "in --gpu-memory's units; --gpu / --gpu-memory stay the card's total, from which SGLang takes "
                        "its defaults and sizes its pool from the free memory (vLLM: only its start-up check, free >= "
                        "total x utilization, read from 0.18; its pool stays a fraction of the total)")


def add_gpu_arguments(group, *, memory_help: str = GPU_MEMORY_HELP) -> None:
    group.add_argument("--gpu", metavar="NAME", help=GPU_HELP)
    group.add_argument("--gpu-memory", metavar="SIZE", help=memory_help)


def gpu_from_args(args):
    """The GpuMemory `--gpu` / `--gpu-memory` say (None when neither is given)."""
    from kvprobe.spec.gpus import gpu_memory

    return gpu_memory(gpu=getattr(args, "gpu", None), memory=getattr(args, "gpu_memory", None))
