"""The machine a benchmark ran on, for its records: CPU model, cores, GPU, versions."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe(runs_on: str) -> dict[str, Any]:
    """`runs_on`: where the model ran ("cpu backend on cpu", "served at URL")."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": gpu, "backend": runs_on,
            "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform()}
