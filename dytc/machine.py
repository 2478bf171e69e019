"""What identifies the machine a measurement was made on: CPU model and the ISA flags that decide which kernels are
fast, cores and threads, GPU, torch and transformers versions (named with every profile, plane, tuning and result)."""
from __future__ import annotations

import ctypes
import os
import platform
from importlib import metadata


def _cpuinfo(key: str) -> str | None:
    """The value of the first `key` line of /proc/cpuinfo (None where there is none or it is not readable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_model() -> str:
    return _cpuinfo("model name") or platform.processor() or platform.machine()


ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")
# /proc/cpuinfo flags that change which CPU kernels are fast (named with every measurement)


def cpu_flags() -> list[str]:
    """The ISA_FLAGS this CPU reports (empty where /proc/cpuinfo is not readable)."""
    have = set((_cpuinfo("flags") or "").split())
    return [flag for flag in ISA_FLAGS if flag in have]


def _version(pkg: str) -> str | None:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def resident_bytes() -> int:
    """The process's resident memory now (/proc/self/statm: pages in RAM; 0 where it is not readable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def release_free_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim: after a load's transient buffers, so
    that resident memory is what the process holds; nothing where the C library has no such call)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def machine_info(device: str = "cpu") -> dict:
    """What identifies the machine a measurement was made on (for profiles, cpu and gpu are the matching keys;
    cpu_flags names the ISA extensions that decide which kernels are fast)."""
    import torch

    gpu = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cpu_flags": cpu_flags(), "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "gpu": gpu, "torch": torch.__version__, "transformers": _version("transformers"),
            "platform": platform.platform()}
