"""The filesystem a call sees at the ``namespaces`` level: the Python installation, the system's
programs and libraries, and its own scratch space. Nothing else of the host exists there, so
datasets, checkpoints, home directories and host sockets cannot even be named.

The template builds this view once (``enter_minimal_root``): a read-only tmpfs root holding
read-only, ``nosuid`` binds of

- the installation (``installation_paths``): the interpreter's prefixes, every directory on
  ``sys.path`` and ``LD_LIBRARY_PATH``, each at the path Python knows it by and at its resolved
  path, with fresh ``0755`` directories as ancestors (so a venv under a ``0700`` home directory
  is reachable without exposing the rest of that directory);
- ``/usr`` and the ``/bin``, ``/lib``... links or directories beside it (shared libraries that
  lazily imported extension modules load; programs such as ``sleep`` that calls may run), and
  ``/etc/ld.so.cache``;
- the devices ``null``, ``zero``, ``full``, ``random`` and ``urandom``.

Each call then gets its own mount namespace (``enter_call_filesystem``): its own ``/proc``,
and a tmpfs on ``/tmp`` (also ``/dev/shm``) owned by its slot uid, capped in bytes and in
entries. Installation
directories under ``/tmp`` are bound back into that tmpfs, read-only, so the scratch space never
hides the interpreter's packages.
"""
from __future__ import annotations

import os
import stat
import sys

from rstar2_jax.sandbox.containment import (MS_BIND, MS_NODEV, MS_NOEXEC, MS_NOSUID, MS_PRIVATE, MS_RDONLY,
                                            MS_REC, MS_REMOUNT, mount, pivot_root, umount_detached)

SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
SYSTEM_FILES = ("/etc/ld.so.cache",)
DEVICES = ("null", "zero", "full", "random", "urandom")
SCRATCH = "/tmp"
# Entries of a call's scratch tmpfs, hard links included: without a cap, ~1.8 million links to
# one file held the call's teardown, after its deadline, for ~30% of that deadline.
SCRATCH_INODES = 4096
_READ_ONLY = MS_RDONLY | MS_NOSUID | MS_NODEV


def installation_paths(hidden: str | None = None) -> list[str]:
    """Paths this interpreter (and so every call forked from it) reads, as named and resolved.

    ``hidden`` is left out unless it lies inside an interpreter prefix: the source checkout of
    this package, which calls never import and which may hold data and checkpoints.
    """
    prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    named = set(prefixes)
    named.update(p for p in sys.path if p)
    named.update(p for p in os.environ.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p)
    paths = set()
    for path in named:
        path = os.path.abspath(path)
        if not os.path.exists(path):
            continue
        if hidden is not None and path == os.path.abspath(hidden) and not any(
                _is_within(path, p) for p in prefixes):
            continue
        paths.update((path, os.path.realpath(path)))
    if "/" in paths:
        raise ValueError("sys.path or LD_LIBRARY_PATH names '/'; sandboxed calls would see the whole "
                         "filesystem. Remove '/' (or '.' run from '/') from PYTHONPATH/LD_LIBRARY_PATH")
    for path in sorted(paths):
        mode = os.stat(path).st_mode
        needed = stat.S_IROTH | (stat.S_IXOTH if stat.S_ISDIR(mode) else 0)
        if mode & needed != needed:
            raise PermissionError(
                f"{path} (part of the Python installation) is not readable by other users "
                f"(mode {stat.S_IMODE(mode):04o}); sandboxed calls run as unprivileged uids and could "
                f"not import from it. Make it readable (chmod -R o+rX {path}) or use isolation='none'")
    return sorted(paths)


def _is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _outermost(paths: list[str]) -> list[str]:
    """Drop paths that the bind of an enclosing path already shows (no link or mount between)."""
    kept = []
    for path in sorted(paths):
        if not any(_is_within(path, outer)
                   and os.path.realpath(path) == os.path.join(os.path.realpath(outer), os.path.relpath(path, outer))
                   and os.stat(path).st_dev == os.stat(outer).st_dev for outer in kept):
            kept.append(path)
    return kept


def _make_mountpoint(target: str, like_dir: bool) -> None:
    os.makedirs(target if like_dir else os.path.dirname(target), mode=0o755, exist_ok=True)
    if not like_dir and not os.path.exists(target):
        os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o444))


def _bind(source: str, target: str, flags: int = _READ_ONLY) -> None:
    """Bind ``source`` (non-recursively: submounts stay hidden) at ``target``, then apply ``flags``."""
    _make_mountpoint(target, os.path.isdir(source))
    mount(source, target, None, MS_BIND)
    mount("none", target, None, MS_REMOUNT | MS_BIND | flags)


def enter_minimal_root(paths: list[str]) -> None:
    """Make this process's root a read-only view of ``paths`` and the system's programs.

    The caller must already be in a private mount namespace. The host stays reachable under
    ``/old`` of a scaffolding tmpfs while the new root is assembled (so bind sources are named
    by their resolved host path), then both are detached.
    """
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    # Everything about the host is looked up now, while its paths still resolve.
    system = [(d, os.readlink(d) if os.path.islink(d) else os.path.realpath(d))
              for d in SYSTEM_DIRS if os.path.lexists(d)]
    system_files = [(f, os.path.realpath(f)) for f in SYSTEM_FILES if os.path.isfile(f)]
    sources = {p: os.path.realpath(p) for p in _outermost(paths)}
    # Scaffolding: pivot into a tmpfs so the host is at /old and the new root can be built at
    # /new from any host path, including ones under the directory the tmpfs was mounted on.
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0700")
    os.mkdir("/tmp/old")
    os.mkdir("/tmp/new")
    pivot_root("/tmp", "/tmp/old")
    os.chdir("/")
    mount("tmpfs", "/new", "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name, target in system:
        if os.path.islink("/old" + name):
            os.symlink(target, "/new" + name)
        else:
            _bind("/old" + target, "/new" + name)
    for name, source in system_files:
        _bind("/old" + source, "/new" + name)
    os.makedirs("/new/dev/shm", mode=0o755)
    for dev in DEVICES:
        if os.path.exists(f"/old/dev/{dev}"):
            _bind(f"/old/dev/{dev}", f"/new/dev/{dev}", MS_RDONLY | MS_NOSUID)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/new/dev/{name}")
    os.mkdir("/new/proc", 0o555)
    os.makedirs("/new" + SCRATCH, mode=0o755, exist_ok=True)
    # Parents before children: a directory nested in an already bound one is bound onto the
    # existing directory of that bind.
    for path in sorted(sources):
        if not os.path.exists("/new" + path):
            _make_mountpoint("/new" + path, os.path.isdir("/old" + sources[path]))
        mount("/old" + sources[path], "/new" + path, None, MS_BIND)
        mount("none", "/new" + path, None, MS_REMOUNT | MS_BIND | _READ_ONLY)
    mount("none", "/new", None, MS_REMOUNT | MS_BIND | _READ_ONLY)
    # pivot_root(".", ".") stacks the old root on the new one; detaching it drops the host view.
    os.chdir("/new")
    pivot_root(".", ".")
    umount_detached(".")
    os.chdir("/")


def paths_under_scratch(paths: list[str]) -> list[str]:
    """The installation paths that the per-call scratch tmpfs would cover (outermost only)."""
    inside = sorted(p for p in paths if _is_within(p, SCRATCH) and p != SCRATCH)
    return [p for p in inside if not any(o != p and _is_within(p, o) for o in inside)]


def enter_call_filesystem(scratch_bytes: int, uid: int, rebind: list[str]) -> str:
    """In a call's child (PID 1 of its PID namespace, in a fresh mount namespace): its own
    ``/proc``, a private size-capped ``/tmp`` (also ``/dev/shm``) and the installation paths in
    ``rebind`` bound back into it. Returns the working directory."""
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    # Open the installation directories before the tmpfs covers them; bind them back from
    # their descriptors (a bind of a mount in this namespace keeps its read-only flags).
    held = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in rebind]
    opts = f"size={scratch_bytes},nr_inodes={SCRATCH_INODES},mode=0700,uid={uid},gid={uid}"
    mount("tmpfs", SCRATCH, "tmpfs", MS_NOSUID | MS_NODEV, opts)
    for path, fd in zip(rebind, held):
        _make_mountpoint(path, stat.S_ISDIR(os.fstat(fd).st_mode))
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    mount(SCRATCH, "/dev/shm", None, MS_BIND)
    return SCRATCH
