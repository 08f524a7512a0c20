"""Limits and sizing of the sandbox pool.

One frozen dataclass travels from the pool to every template process (as JSON), so the parent
and the templates always agree on the limits.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os

ISOLATION_LEVELS = ("namespaces", "uid", "none")
# The template waits with poll(), whose timeout is milliseconds in a C int (24.8 days); no tool
# call needs a day.
MAX_TIMEOUT_S = 24 * 3600.0
# Limits become rlimits and cgroup values: 64-bit integers in the kernel.
_MAX_LIMIT = 1 << 62


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """Per-call limits and pool sizing.

    Attributes:
      timeout_s: wall-clock limit of one call, seconds, measured from the fork of its child.
        rStar2 ran its tool with 4 s.
      cpu_s: RLIMIT_CPU of one call, seconds (catches C-level loops that ignore signals);
        defaults to ``ceil(timeout_s) + 1``.
      memory_bytes: memory of one call, bytes: RLIMIT_AS of each of its processes (which
        counts the forked template's address space, ~0.2 GiB with numpy and sympy, so keep it
        well above that) and, where the template may create memory cgroups, the limit of the
        cgroup that holds all of its processes (see docs/sandbox.md).
      max_processes: RLIMIT_NPROC of one call (processes and threads of its slot uid).
      max_file_bytes: RLIMIT_FSIZE, the largest file one call may write, bytes.
      max_open_files: RLIMIT_NOFILE of one call.
      output_limit_bytes: cap on each of stdout and stderr, bytes; a call that writes more is
        killed with status ``output_limit``. Only this much is ever buffered.
      scratch_bytes: size of the call's private tmpfs ``/tmp``, its working directory
        (namespaces level).
      pool_memory_bytes: memory all the calls of a pool hold together, bytes, where the
        templates may create memory cgroups: each template's calls share ``pool_memory_bytes /
        num_workers``, and past it the kernel kills one of them (docs/sandbox.md). None: half of
        the host's memory, or one call's ``memory_bytes`` per template if that is more.
      slots_per_worker: calls one template supervises at once. Sleeping or timing-out calls
        hold a slot without using CPU, so slots are oversubscribed relative to cores.
      isolation: ``"auto"`` picks the strongest level the kernel grants; forcing a level
        is for tests and for hosts where detection is wrong. See docs/sandbox.md.
    """

    timeout_s: float = 4.0
    cpu_s: int | None = None
    memory_bytes: int = 1 << 30
    max_processes: int = 32
    max_file_bytes: int = 16 << 20
    max_open_files: int = 128
    output_limit_bytes: int = 1 << 20
    scratch_bytes: int = 64 << 20
    pool_memory_bytes: int | None = None
    slots_per_worker: int = 8
    isolation: str = "auto"

    def __post_init__(self):
        if not (isinstance(self.timeout_s, (int, float)) and 0 < self.timeout_s <= MAX_TIMEOUT_S):
            raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], got {self.timeout_s!r}")
        for name in ("cpu_s", "memory_bytes", "max_processes", "max_file_bytes", "max_open_files",
                     "output_limit_bytes", "scratch_bytes", "pool_memory_bytes", "slots_per_worker"):
            value = getattr(self, name)
            if name in ("cpu_s", "pool_memory_bytes") and value is None:
                continue
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 < value <= _MAX_LIMIT):
                raise ValueError(f"{name} must be a positive integer up to 2**62, got {value!r}")
        if self.max_open_files < 16:
            raise ValueError("max_open_files below 16 breaks numpy/sympy imports")
        if self.isolation not in ("auto",) + ISOLATION_LEVELS:
            raise ValueError(f"isolation must be 'auto' or one of {ISOLATION_LEVELS}, got {self.isolation!r}")

    @property
    def cpu_limit_s(self) -> int:
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "SandboxConfig":
        return cls(**json.loads(text))


# A template and the zygote it forks its calls from take this much at rest, before any call (63
# MB of proportional set size measured, Python 3.11, the math libraries imported).
TEMPLATE_BYTES = 64 << 20


def host_memory_bytes() -> int:
    """The host's memory (MemTotal)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemTotal:"))


def check_num_workers(num_workers: int) -> None:
    """ValueError where ``num_workers`` templates at rest would not fit in the host's memory:
    each starts a Python process and a zygote (seconds each), and the host would run out of
    memory while they start, long before the first call."""
    total = host_memory_bytes()
    if num_workers * TEMPLATE_BYTES > total:
        raise ValueError(
            f"{num_workers} sandbox templates take about {num_workers * TEMPLATE_BYTES / 2**30:.1f} "
            f"GiB at rest ({TEMPLATE_BYTES >> 20} MiB each, before any call), more than this host's "
            f"{total / 2**30:.1f} GiB: use at most {total // TEMPLATE_BYTES} (one per core, the "
            f"default: {default_num_workers()})")


def pool_memory_bytes(config: SandboxConfig, num_workers: int) -> int:
    """``config.pool_memory_bytes``, or its default for this host; ValueError where it leaves a
    template less than one call's ``memory_bytes``, or where the templates do not fit the host
    (`check_num_workers`)."""
    check_num_workers(num_workers)
    bound = config.pool_memory_bytes
    if bound is None:
        bound = max(host_memory_bytes() // 2, num_workers * config.memory_bytes)
    if bound // num_workers < config.memory_bytes:
        raise ValueError(f"pool_memory_bytes ({bound}) must leave each of the {num_workers} templates at least "
                         f"one call's memory_bytes ({config.memory_bytes})")
    return bound


def default_num_workers() -> int:
    """One template per core the process may use: each runs its calls' CPU work."""
    return len(os.sched_getaffinity(0))
