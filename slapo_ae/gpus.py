"""The GPUs this process may use, found one way for the whole artifact, without torch.

``CUDA_VISIBLE_DEVICES`` wins when set (empty or ``-1`` means none); otherwise the lines
``GPU i: ...`` of ``nvidia-smi -L``; none when there is no ``nvidia-smi`` or it fails. The
planner picks its profile from it, ``slapo-bench run --device auto`` its device, the
launcher refuses a case that asks for more, and the case runner names the device in the
records it writes itself; the GPU slots and the runner's agents split a
``CUDA_VISIBLE_DEVICES`` value with :func:`visible_ids`. Inside a rank, torch describes the
device it trains on (:func:`slapo_ae.harness.metrics.device_info`).
"""
from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess

SMI_TIMEOUT_S = 10.0


def _smi(*args: str) -> list[str] | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.splitlines() if out.returncode == 0 else None


def visible_ids(value: str | None) -> list[str] | None:
    """The device ids a ``CUDA_VISIBLE_DEVICES`` value lists, None when it is unset. As CUDA
    reads it, ``-1`` hides itself and every id after it."""
    if value is None:
        return None
    ids = [v.strip() for v in value.split(",") if v.strip()]
    return ids[:ids.index("-1")] if "-1" in ids else ids


def visible_gpus(env: dict | None = None) -> int:
    """How many GPUs this process may use (see the module docstring)."""
    env = os.environ if env is None else env
    ids = visible_ids(env.get("CUDA_VISIBLE_DEVICES"))
    if ids is not None:
        return len(ids)
    lines = _smi("-L")
    return 0 if lines is None else sum(1 for line in lines if line.startswith("GPU "))


def gpu_name(visible: str | None = None) -> str | None:
    """The name of the first GPU of ``visible`` (a ``CUDA_VISIBLE_DEVICES`` value), or of the
    machine's first GPU; None when ``nvidia-smi`` cannot tell."""
    args = ["--query-gpu=name", "--format=csv,noheader"]
    if visible:
        args += ["-i", visible.split(",")[0]]
    lines = _smi(*args)
    return lines[0].strip() if lines else None


def model_slug(name: str | None) -> str:
    """A GPU's model as a folder name: its model number where the name has one ("NVIDIA H100
    80GB HBM3" -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100"), else the whole name, lowercased
    and dashed; "no-gpu" for none."""
    if not name:
        return "no-gpu"
    model = re.search(r"\b[A-Z]{1,2}\d{2,3}[A-Z]?\b", name)
    return (model.group(0) if model else re.sub(r"[^0-9A-Za-z]+", "-", name).strip("-")).lower()


def describe(device: str, count: int, visible: str | None = None) -> dict:
    """The record's device fields for a run on ``device`` with ``count`` GPUs of ``visible``
    (a ``CUDA_VISIBLE_DEVICES`` value), as far as they are known outside the ranks."""
    if device != "cuda":
        return {"device_name": f"cpu ({platform.machine()})", "device_count": 0, "cuda": None}
    return {"device_name": gpu_name(visible) or "cuda (unknown)", "device_count": count,
            "cuda": None}


if __name__ == "__main__":  # `python -m slapo_ae.gpus`: the count, e.g. for --resources gpus=N
    print(visible_gpus())
