"""A description of the machine a benchmark ran on, for every record it writes."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo with its family and model numbers (a VM's
    name, "AMD EPYC", is the same for Zen 4 and Zen 5 cores, whose figures differ), or the
    platform's word for it elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip():  # the first processor's block is enough
                    break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name


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
