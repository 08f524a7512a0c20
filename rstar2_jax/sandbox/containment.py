"""Linux containment of sandboxed calls: namespaces, mounts, uids, rlimits, sweeps.

Three levels, strongest first (``docs/sandbox.md`` states what each guarantees):

- ``namespaces`` (root with CAP_SYS_ADMIN): the template lives in its own network namespace
  (no interfaces, so no network), IPC namespace and mount namespace (host filesystem read-only,
  unreadable ancestors of the Python installation replaced by a bind of just the installation).
  Each call is PID 1 of a fresh PID namespace, so when it exits or is killed the kernel kills
  every process it started, ``setsid`` or not; its working directory ``/tmp`` is a private
  size-capped tmpfs (also mounted on ``/dev/shm``) that disappears with it.
- ``uid`` (root without namespaces): each call runs as its own slot uid; escapees are found
  by uid in ``/proc`` and killed; the scratch directory is a plain directory removed
  afterwards. No network cut, no size cap on scratch beyond RLIMIT_FSIZE.
- ``none`` (unprivileged): rlimits only; the call's process group and any orphan reparented to
  the template (it is a child subreaper) are killed. RLIMIT_NPROC counts every process of the
  user, so it is not set; a fork bomb is stopped only by the wall deadline.

Everything here runs in a template process or in a call's child, never in the pool's parent.
Python 3.11 has no ``os.unshare``/``os.setns``, hence ctypes.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import stat
import sys

from rstar2_jax.sandbox.config import SandboxConfig

CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(_libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None), f"mount {target}")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0), "prctl")


def _unreadable_ancestor(path: str) -> str | None:
    """The highest ancestor of ``path`` that other users cannot traverse, if any."""
    found = None
    parts = os.path.realpath(path).split(os.sep)
    for i in range(2, len(parts)):
        ancestor = os.sep.join(parts[:i])
        try:
            if not os.stat(ancestor).st_mode & stat.S_IXOTH:
                found = found or ancestor
        except FileNotFoundError:
            break
    return found


def _python_roots() -> list[str]:
    """Directories the call's interpreter must read: installation prefixes and sys.path."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix}
    paths.update(p for p in sys.path if p and os.path.isdir(p))
    roots = sorted({os.path.realpath(p) for p in paths})
    # Drop roots nested in another root: binding the outer one exposes them.
    return [r for r in roots if not any(r != o and r.startswith(o + os.sep) for o in roots)]


def setup_template_namespaces() -> None:
    """Move the calling template into private net/IPC/mount namespaces. Raises OSError if denied.

    Mount view afterwards: ``/`` read-only (a per-mount bind flag, the host is unaffected); each
    directory that hides the Python installation from other users (here ``/root``, mode 0700)
    is covered by an empty tmpfs into which only the needed directories are bound back, so a
    call running as a slot uid can import any module but cannot see the rest of ``/root``.
    """
    unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC)
    mount("none", "/", None, MS_REC | MS_PRIVATE)
    os.chdir("/")
    roots = _python_roots()
    covers = sorted({a for a in map(_unreadable_ancestor, roots) if a})
    staging = "/dev/shm"  # a tmpfs that exists everywhere; replaced per call anyway
    mount("tmpfs", staging, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0700")
    hidden = [r for r in roots if any(r.startswith(c + os.sep) for c in covers)]
    for i, root in enumerate(hidden):
        os.mkdir(f"{staging}/{i}")
        mount(root, f"{staging}/{i}", None, MS_BIND | MS_REC)
    for cover in covers:
        mount("tmpfs", cover, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for i, root in enumerate(hidden):
        os.makedirs(root, mode=0o755, exist_ok=True)
        mount(f"{staging}/{i}", root, None, MS_MOVE)
    mount("none", "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY)


def probe_pid_namespace(orig_pidns_fd: int) -> None:
    """Check that a per-call PID namespace can be made and left again; raise OSError if not."""
    unshare(CLONE_NEWPID)
    setns(orig_pidns_fd, CLONE_NEWPID)


def set_call_limits(config: SandboxConfig, level: str) -> None:
    """Apply the per-call rlimits (in the call's child, before dropping privileges)."""
    cpu = config.cpu_limit_s
    limits = [
        (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # soft: SIGXCPU; hard: SIGKILL one second later
        (resource.RLIMIT_AS, (config.memory_bytes, config.memory_bytes)),
        (resource.RLIMIT_FSIZE, (config.max_file_bytes, config.max_file_bytes)),
        (resource.RLIMIT_NOFILE, (config.max_open_files, config.max_open_files)),
        (resource.RLIMIT_CORE, (0, 0)),
    ]
    if level != "none":
        # Counted per real uid across the host, so only meaningful with a uid per slot.
        limits.append((resource.RLIMIT_NPROC, (config.max_processes, config.max_processes)))
    for which, value in limits:
        resource.setrlimit(which, value)


def drop_privileges(uid: int) -> None:
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def enter_call_namespaces(scratch_bytes: int, uid: int) -> str:
    """In the call's child (PID 1 of its new PID namespace): private /tmp, /dev/shm and /proc.

    Returns the working directory. Everything mounted here vanishes with the namespace.
    """
    unshare(CLONE_NEWNS)
    opts = f"size={scratch_bytes},mode=0700,uid={uid},gid={uid}"
    mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts)
    mount("/tmp", "/dev/shm", None, MS_BIND)
    # A /proc of this namespace only: the call cannot see or signal host processes by pid.
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV)
    return "/tmp"


def processes_of_uid(uid: int) -> list[int]:
    """Pids of live processes whose real uid is ``uid`` (scan of /proc)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/status", "rb") as f:
                for line in f:
                    if line.startswith(b"Uid:"):
                        if int(line.split()[1]) == uid:
                            pids.append(int(name))
                        break
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    return pids


def kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid`` until none is left (new forks race the scan)."""
    for _ in range(100):
        pids = processes_of_uid(uid)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads), from /proc."""
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
    except FileNotFoundError:
        pass
    return out
