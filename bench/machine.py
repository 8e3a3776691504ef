"""What the numbers were measured on: CPU, memory (with a page-fault probe), disk (with an fsync
probe), versions, load."""

from __future__ import annotations

import hashlib
import os
import platform
import random
import resource
import sqlite3
import statistics
import struct
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson
import psutil

__all__ = ["cpu_probe", "describe", "fault_probe", "fsync_probe", "load_snapshot"]

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sqlalchemy", "aiosqlite", "asyncpg", "fastapi", "uvicorn", "httpx", "pydantic")


def fsync_probe(directory: Path, n: int = 200) -> dict[str, float]:
    """Latency of write(4 KiB) + fdatasync on the disk the databases live on: the floor of one
    durable commit."""
    path = directory / "fsync-probe.bin"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    lat: list[float] = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            os.write(fd, b"\0" * 4096)
            os.fdatasync(fd)
            lat.append((time.perf_counter() - t0) * 1e3)
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    lat.sort()
    return {
        "n": n,
        "p50_ms": lat[n // 2],
        "p90_ms": lat[int(n * 0.9)],
        "per_s": n / (sum(lat) / 1e3),
    }


def fault_probe(mib: int = 64, rounds: int = 3) -> dict[str, float]:
    """What fresh memory costs this process: ``mib`` MiB taken from the system and written once
    (one minor page fault per page), median of ``rounds``.  A build's output lists are fresh
    memory the first time a process makes them; on a virtual machine a first touch can cost
    several times what it costs on bare metal, and it moves every absolute build time."""
    per_fault: list[float] = []
    per_mib: list[float] = []
    faults = 0
    for _ in range(rounds):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        block = b"\x01" * (mib << 20)  # above malloc's mmap threshold: fresh pages, freed at once
        took = time.perf_counter() - t0
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        del block
        per_fault.append(took / max(faults, 1) * 1e6)
        per_mib.append(took / mib * 1e3)
    return {
        "mib": mib,
        "faults": faults,
        "us_per_fault": sorted(per_fault)[rounds // 2],
        "ms_per_mib": sorted(per_mib)[rounds // 2],
    }


def cpu_probe(rounds: int = 5) -> dict[str, float]:
    """How fast this process ran fixed CPU work, median of ``rounds``: the interpreter (a
    pure-Python loop of 200,000 steps, what most of a call's bookkeeping is) and a 16k-token
    prompt's C-speed steps (orjson parse of its ids, int32 packing, SHA-256).

    The CPU's name says little on a virtual machine (the same name has come with very different
    speeds), yet every absolute figure (a call's ms, a build's ms) and every ratio against a
    store that waits on the disk more than on the CPU moves with the CPU's speed.  Taken at a
    run's start and end: the machine may be shared, so its speed changes within a run."""
    ids = [random.Random(12).randrange(150_000) for _ in range(16_000)]
    text = orjson.dumps(ids)
    loop: list[float] = []
    c_speed: list[float] = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        acc = 0
        for i in range(200_000):
            acc += i & 7
        loop.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        parsed = orjson.loads(text)
        hashlib.sha256(struct.pack(f"<{len(parsed)}i", *parsed)).digest()
        c_speed.append((time.perf_counter() - t0) * 1e3)
    return {
        "rounds": rounds,
        "python_loop_ms": statistics.median(loop),
        "ids_16k_ms": statistics.median(c_speed),
    }


def _disk(directory: Path) -> dict[str, Any]:
    best = None
    for part in psutil.disk_partitions(all=False):
        if str(directory).startswith(part.mountpoint) and (
            best is None or len(part.mountpoint) > len(best.mountpoint)
        ):
            best = part
    usage = psutil.disk_usage(str(directory))
    out: dict[str, Any] = {
        "path": directory.name,  # the run's scratch folder by name: no host paths in results
        "device": best.device if best else None,
        "fstype": best.fstype if best else None,
        "size_gib": round(usage.total / 2**30, 1),
        "free_gib": round(usage.free / 2**30, 1),
    }
    if best and best.device.startswith("/dev/"):
        rot = Path(f"/sys/block/{Path(best.device).name}/queue/rotational")
        if rot.exists():
            out["rotational"] = rot.read_text().strip() == "1"
    return out


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> dict[str, Any]:
    def run(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": run("rev-parse", "--short", "HEAD"), "dirty": bool(run("status", "--short"))}


def load_snapshot() -> dict[str, Any]:
    """Load average and system-wide CPU busy % since the previous snapshot (a shared machine
    makes every number here noisier; the report shows this next to them)."""
    return {
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "cpu_busy_pct": psutil.cpu_percent(interval=None),
    }


async def describe(workdir: Path, pg_version: str | None) -> dict[str, Any]:
    vm = psutil.virtual_memory()
    versions = {}
    for pkg in PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return {
        "cpu": _cpu_model(),
        "nproc": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)),
        "memory_gib": round(vm.total / 2**30, 1),
        "disk": _disk(workdir),
        "fsync": fsync_probe(workdir),
        "fresh_memory": fault_probe(),
        "cpu_probe": cpu_probe(),
        "os": f"{platform.system()} {platform.release()}",
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
        "postgres": pg_version,
        "packages": versions,
        "git": _git(),
    }
