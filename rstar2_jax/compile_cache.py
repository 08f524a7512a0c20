"""JAX's persistent compilation cache, and a count of what a job compiles.

Every ``python -m rstar2_jax`` job calls :func:`enable_persistent_cache` before it compiles
anything: each program XLA compiles is written to a cache directory, and a later job that
compiles the same program (same computation, shapes, shardings, JAX version and device kind)
loads it from there instead. The directory is, in order of preference:

1. ``$JAX_COMPILATION_CACHE_DIR`` (JAX's own variable) when it is set;
2. ``$XDG_CACHE_HOME/rstar2_jax/jax`` when ``XDG_CACHE_HOME`` is set;
3. ``~/.cache/rstar2_jax/jax``.

``JAX_ENABLE_COMPILATION_CACHE=false`` turns the cache off. JAX trusts what it loads from the
cache (an entry is an executable), so the directory must be writable by its user only: that is
why it lives in the user's cache directory and never inside the repository. It grows by one
file per distinct program (the toy's main job: a few hundred files, tens of MB); deleting it is
always safe.

:class:`CompileCounter` counts the programs compiled while it is open, through
``jax.monitoring`` events: a program XLA compiled, one loaded from the persistent cache, and the
time spent tracing and lowering (paid again by every process, cache or not), and the programs
by name.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import jax

# Event names of jax._src.dispatch and jax._src.compiler (stable across JAX releases since 0.4.20).
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_TRACE_AND_LOWER = ("/jax/core/compile/jaxpr_trace_duration",
                    "/jax/core/compile/jaxpr_to_mlir_module_duration")


def default_cache_dir() -> Path:
    """Where the cache lives unless ``JAX_COMPILATION_CACHE_DIR`` says otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rstar2_jax" / "jax"


def enable_persistent_cache() -> Path | None:
    """Turns JAX's persistent compilation cache on for this process (see the module docstring);
    returns its directory, or None when ``JAX_COMPILATION_CACHE_DIR`` is empty or
    ``JAX_ENABLE_COMPILATION_CACHE`` is false.

    Call it before the first compilation: JAX decides once per process whether it uses a cache.
    Every program is cached, however fast it compiled (JAX's default skips those under 1 s,
    which on a CPU is most of them).
    """
    if not jax.config.jax_enable_compilation_cache:
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if path == "":
        return None
    directory = Path(path) if path else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


@dataclasses.dataclass
class CompileStats:
    """Programs a process compiled (XLA ran) or loaded from the persistent cache, with seconds.

    ``trace_s`` is tracing to a jaxpr and lowering to MLIR, which a cache hit does not save.
    ``programs`` counts them (compiled or loaded) by JAX's name of each, ``jit(<function>)``.
    """

    compiled: int = 0
    compile_s: float = 0.0
    loaded: int = 0
    load_s: float = 0.0
    trace_s: float = 0.0
    programs: dict[str, int] = dataclasses.field(default_factory=dict)

    def __sub__(self, other: CompileStats) -> CompileStats:
        numbers = [f.name for f in dataclasses.fields(self) if f.name != "programs"]
        programs = {k: n - other.programs.get(k, 0) for k, n in self.programs.items()}
        return CompileStats(*(getattr(self, k) - getattr(other, k) for k in numbers),
                            programs={k: n for k, n in programs.items() if n})

    def summary(self) -> str:
        return (f"compiled {self.compiled} programs in {self.compile_s:.1f} s, loaded {self.loaded} "
                f"from the cache in {self.load_s:.1f} s, tracing and lowering {self.trace_s:.1f} s")


class CompileCounter:
    """Counts compilations in this process while open (``with CompileCounter() as c``);
    ``c.stats`` is the running total, ``c.stats - earlier`` a phase's share."""

    def __init__(self):
        self.stats = CompileStats()
        self._hit = threading.local()  # a cache hit is reported just before its compile event
        self._lock = threading.Lock()

    def _on_event(self, event: str, **_) -> None:
        if event == _CACHE_HIT:
            self._hit.pending = True

    def _on_duration(self, event: str, seconds: float, fun_name: str = "?", **_) -> None:
        with self._lock:
            if event == _BACKEND_COMPILE:
                self.stats.programs[fun_name] = self.stats.programs.get(fun_name, 0) + 1
                if getattr(self._hit, "pending", False):
                    self._hit.pending = False
                    self.stats.loaded += 1
                    self.stats.load_s += seconds
                else:
                    self.stats.compiled += 1
                    self.stats.compile_s += seconds
            elif event in _TRACE_AND_LOWER:
                self.stats.trace_s += seconds

    def snapshot(self) -> CompileStats:
        with self._lock:
            return dataclasses.replace(self.stats, programs=dict(self.stats.programs))

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_listener(self._on_event)
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._on_event)
        jax.monitoring.unregister_event_duration_listener(self._on_duration)

