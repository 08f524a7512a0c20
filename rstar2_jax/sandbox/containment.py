"""Linux containment of sandboxed calls: namespaces, mounts, uids, rlimits, sweeps.

Three levels, strongest first (``docs/sandbox.md`` states what each guarantees):

- ``namespaces`` (root with CAP_SYS_ADMIN): the template lives in its own network namespace
  (no interfaces, so no network) and mount namespace, whose root is a read-only view of the
  Python installation and the system's programs only (``filesystem``). Each call is PID 1 of a
  fresh PID namespace, so when it exits or is killed the kernel kills every process it
  started, ``setsid`` or not; it has its own IPC namespace (SysV shared memory and message
  queues die with it) and mount namespace, with a private size-capped tmpfs on ``/tmp``. It
  enters its slot's network namespace, made once by the template (a new one per call costs
  about 1 ms of CPU): concurrent calls never share one, so their ports, netlink sockets and
  abstract socket names never meet, and every socket of a call is gone before its slot's next
  call starts.
- ``uid`` (root without namespaces): each call runs as its own slot uid; escapees are found
  by uid in ``/proc`` and killed; the scratch directory is a plain directory removed
  afterwards. No network cut, no size cap on scratch beyond RLIMIT_FSIZE.
- ``none`` (unprivileged): rlimits only; the call's process group and any orphan reparented to
  the zygote (it is a child subreaper) are killed. RLIMIT_NPROC counts every process of the
  user, so it is not set; a fork bomb is stopped only by the wall deadline.

At every level a call runs with ``no_new_privs`` and the seccomp filter of ``seccomp``, and,
where the host lets the template create cgroups, inside its slot's cgroups (``cgroup``).

Everything here runs in a template process or in a call's child, never in the pool's parent.
Python 3.11 has no ``os.unshare``/``os.setns``, hence ctypes.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal

from rstar2_jax.sandbox.config import SandboxConfig

CLONE_FILES = 0x00000400
CLONE_NEWNS = 0x00020000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
# pivot_root has no libc wrapper; its number differs between the architectures JAX runs on.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}.get(os.uname().machine, -1)

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


def prctl(option: int, arg2: int, arg3: int = 0) -> None:
    _check(_libc.prctl(option, ctypes.c_ulong(arg2), ctypes.c_ulong(arg3), 0, 0), "prctl")


def pivot_root(new_root: str, put_old: str) -> None:
    _check(_libc.syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


def umount_detached(target: str) -> None:
    _check(_libc.umount2(target.encode(), MNT_DETACH), f"umount {target}")


def set_no_new_privs() -> None:
    """Nothing this process or its children execute can gain privileges (setuid bits, file
    capabilities); also what lets an unprivileged process install a seccomp filter."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)


def new_network_namespace() -> int:
    """A descriptor of a new, empty network namespace; this process stays in its own."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        unshare(CLONE_NEWNET)
        try:
            return os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            setns(own, CLONE_NEWNET)
    finally:
        os.close(own)


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
