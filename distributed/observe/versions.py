"""The versions and card a record carries: Python, torch, CUDA, NCCL, CuPy, driver, date."""

from __future__ import annotations

import datetime
import platform
from typing import Any

import torch


def environment_facts() -> dict[str, Any]:
    """Card, driver and library versions that every record carries."""
    facts: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "card": "cpu",
    }
    if torch.cuda.is_available():
        facts["card"] = torch.cuda.get_device_name(0)
        facts["cuda"] = torch.version.cuda
        facts["gpus"] = torch.cuda.device_count()
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - an optional fact
            pass
        try:
            import cupy

            facts["cupy"] = cupy.__version__
            facts["driver"] = cupy.cuda.runtime.driverGetVersion()
        except Exception:  # noqa: BLE001 - CuPy is optional
            pass
    return facts


def versions() -> dict[str, Any]:
    """`environment_facts` plus Python's version: what the main job's --json record carries."""
    return {"python": platform.python_version(), **environment_facts()}
