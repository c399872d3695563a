"""A description of the machine a benchmark ran on, for every record it writes."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (the platform's word for it elsewhere)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(backend: str, device: torch.device) -> dict[str, Any]:
    """CPU model, cores, torch threads, the backend and its device, the native CPU kernels'
    instruction sets and the kernel's transparent huge page mode (the CPU backend's weights
    take 2 MiB pages under `always` or `madvise`), and the GPU where the device is one."""
    from localllm.backends.cpu.dispatch import native_kernels
    from localllm.backends.cpu.weight_arena import huge_pages_setting

    gpu = None
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "backend": backend, "device": device.type,
            "native_kernels": native_kernels() if backend == "cpu" else "not used",
            "huge_pages": huge_pages_setting() if backend == "cpu" else "not used",
            "gpu": gpu, "os": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "torch": torch.__version__}
