"""The seccomp filter every call runs under: the few kernel interfaces that reach past the
call's namespaces, or between calls, are refused with EPERM.

- Sockets of any family but IPv4, IPv6 and netlink's NETLINK_ROUTE. Those live in the call's
  own empty network namespace; others do not: a unix socket file in a directory the call can
  see (even on a read-only mount) or an abstract unix name would connect to a host process,
  vsock reaches the hypervisor, and a NETLINK_KOBJECT_UEVENT socket receives the host's device
  events in every network namespace. ``socketpair`` stays allowed (asyncio and
  ``multiprocessing`` pipes use it; it connects to nothing).
- IPv6 flow labels (``setsockopt(IPPROTO_IPV6, IPV6_FLOWLABEL_MGR)``): the kernel keeps a label
  in the network namespace for up to a minute after its socket closes, where the slot's next
  call would read it in ``/proc/net/ip6_flowlabel``.
- New namespaces (``unshare``, and ``clone`` with a ``CLONE_NEW*`` flag): an unprivileged
  process may create a user namespace, in which it is root with every capability: it could
  mount cgroup and other filesystems, configure network devices and reach netfilter, the usual
  start of kernel exploits from containers. ``clone3`` passes its flags in memory that a
  filter cannot read, so it fails with ENOSYS, on which the C library falls back to ``clone``
  (as it does on kernels older than 5.3).
- The kernel keyrings (``add_key``, ``request_key``, ``keyctl``): a slot uid's keyring outlives
  its call and is shared by every call that runs as that uid.
- Locks and watches on files every call (and the trainer) can open, the installation and
  ``/dev/null``: they would block, or signal to, other calls, or show which files they open.
  ``flock``, POSIX record and OFD locks and leases (``fcntl`` F_GETLK/F_SETLK/F_SETLKW,
  F_OFD_*, F_SETLEASE/F_GETLEASE), ``inotify``, ``fanotify`` and dnotify (``fcntl`` F_NOTIFY).
- The page cache, which every call shares for the installation's files: what evicts a page
  (``posix_fadvise``, ``madvise`` MADV_COLD/MADV_PAGEOUT, ``process_madvise``) writes a bit that
  what probes it without reading it in (``mincore``, ``cachestat``, RWF_NOWAIT on
  ``preadv2``/``pwritev2``, Linux AIO's ``io_setup``/``io_submit``, whose requests carry
  RWF_NOWAIT in memory a filter cannot read, ``readahead``) reads back exactly.
- ``io_uring``, which performs socket and file operations without passing through this filter.
- Any syscall of another ABI (32-bit ``int 0x80`` or x32 on x86_64), whose numbers this
  filter does not check.

The sync family (``sync``, ``syncfs``, ``fsync``, ``fdatasync``, ``sync_file_range``) returns 0
without reaching the kernel: a call's only writable files are on its tmpfs, where syncing does
nothing, while ``sync`` waits for the host's writeback (a checkpoint being written), in a sleep
that SIGKILL does not interrupt, past the call's deadline.

Only x86_64 and aarch64 are described (the architectures JAX runs on); elsewhere
``call_filter`` returns None and calls run without a filter (docs/sandbox.md says so).
"""
from __future__ import annotations

import ctypes
import errno
import os
import struct
import sys

from rstar2_jax.sandbox.containment import prctl

# AUDIT_ARCH_* and syscall numbers; aarch64 has no inotify_init (only inotify_init1).
_ABIS = {
    "x86_64": dict(arch=0xC000003E, socket=41, clone=56, unshare=272, setsockopt=54, fcntl=72, madvise=28,
                   preadv2=327, pwritev2=328, refused=(
        248, 249, 250,  # add_key, request_key, keyctl
        73,  # flock
        253, 294,  # inotify_init, inotify_init1
        300, 301,  # fanotify_init, fanotify_mark
        221, 27, 187,  # fadvise64, mincore, readahead
        206, 209,  # io_setup, io_submit
    ), skipped=(
        162, 306, 74, 75, 277,  # sync, syncfs, fsync, fdatasync, sync_file_range
    )),
    "aarch64": dict(arch=0xC00000B7, socket=198, clone=220, unshare=97, setsockopt=208, fcntl=25, madvise=233,
                    preadv2=286, pwritev2=287, refused=(
        217, 218, 219,  # add_key, request_key, keyctl
        32,  # flock
        26,  # inotify_init1
        262, 263,  # fanotify_init, fanotify_mark
        223, 232, 213,  # fadvise64, mincore, readahead
        0, 2,  # io_setup, io_submit
    ), skipped=(
        81, 267, 82, 83, 84,  # sync, syncfs, fsync, fdatasync, sync_file_range
    )),
}
# One number on every architecture: io_uring_setup, _enter, _register; process_madvise; cachestat.
_EVERYWHERE_REFUSED = (425, 426, 427, 440, 451)
_CLONE3 = 435  # one number on every architecture
_X32_SYSCALL_BIT = 0x40000000
_ALLOWED_FAMILIES = (2, 10)  # AF_INET, AF_INET6; AF_NETLINK only for NETLINK_ROUTE
_AF_NETLINK, _NETLINK_ROUTE = 16, 0
_IPPROTO_IPV6, _IPV6_FLOWLABEL_MGR = 41, 32
# fcntl commands: F_GETLK, F_SETLK, F_SETLKW, F_OFD_GETLK, F_OFD_SETLK, F_OFD_SETLKW (record
# locks), F_SETLEASE, F_GETLEASE, F_NOTIFY (dnotify)
_REFUSED_FCNTL = (5, 6, 7, 36, 37, 38, 1024, 1025, 1026)
_RWF_NOWAIT = 0x8
_MADV_COLD, _MADV_PAGEOUT = 20, 21
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_NEW_NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]. Arguments are
# compared on their low 32 bits, all the kernel reads of the int arguments checked here.
_NR, _ARCH = 0, 4


def _arg_low(index: int) -> int:
    return 16 + 8 * index + (0 if sys.byteorder == "little" else 4)


def call_filter() -> bytes | None:
    """The classic-BPF program (``struct sock_filter`` array) for this machine, or None."""
    abi = _ABIS.get(os.uname().machine)
    if abi is None:
        return None
    # A string labels the next instruction; an instruction is (opcode, k, jump-if-true label,
    # jump-if-false label). Jumps only go forward.
    program = [
        (_LD_W_ABS, _ARCH, None, None),
        (_JEQ_K, abi["arch"], None, "deny"),
        (_LD_W_ABS, _NR, None, None),
        (_JGE_K, _X32_SYSCALL_BIT, "deny", None),
        *[(_JEQ_K, nr, "deny", None) for nr in abi["refused"] + _EVERYWHERE_REFUSED],
        *[(_JEQ_K, nr, "skip", None) for nr in abi["skipped"]],
        (_JEQ_K, _CLONE3, "enosys", None),
        (_JEQ_K, abi["clone"], "namespaces", None),
        (_JEQ_K, abi["unshare"], "namespaces", None),
        (_JEQ_K, abi["setsockopt"], "setsockopt", None),
        (_JEQ_K, abi["fcntl"], "fcntl", None),
        (_JEQ_K, abi["madvise"], "madvise", None),
        (_JEQ_K, abi["preadv2"], "rw_flags", None),
        (_JEQ_K, abi["pwritev2"], "rw_flags", None),
        (_JEQ_K, abi["socket"], "socket", "allow"),
        "namespaces",
        (_LD_W_ABS, _arg_low(0), None, None),
        (_JSET_K, _NEW_NAMESPACE_FLAGS, "deny", "allow"),
        "setsockopt",
        (_LD_W_ABS, _arg_low(1), None, None),
        (_JEQ_K, _IPPROTO_IPV6, None, "allow"),
        (_LD_W_ABS, _arg_low(2), None, None),
        (_JEQ_K, _IPV6_FLOWLABEL_MGR, "deny", "allow"),
        "fcntl",
        (_LD_W_ABS, _arg_low(1), None, None),
        *[(_JEQ_K, cmd, "deny", None) for cmd in _REFUSED_FCNTL[:-1]],
        (_JEQ_K, _REFUSED_FCNTL[-1], "deny", "allow"),
        "madvise",
        (_LD_W_ABS, _arg_low(2), None, None),
        (_JEQ_K, _MADV_COLD, "deny", None),
        (_JEQ_K, _MADV_PAGEOUT, "deny", "allow"),
        "rw_flags",
        (_LD_W_ABS, _arg_low(5), None, None),
        (_JSET_K, _RWF_NOWAIT, "deny", "allow"),
        "socket",
        (_LD_W_ABS, _arg_low(0), None, None),
        *[(_JEQ_K, family, "allow", None) for family in _ALLOWED_FAMILIES],
        (_JEQ_K, _AF_NETLINK, None, "deny"),
        (_LD_W_ABS, _arg_low(2), None, None),
        (_JEQ_K, _NETLINK_ROUTE, "allow", "deny"),
        "deny",
        (_RET_K, _ERRNO | errno.EPERM, None, None),
        "enosys",
        (_RET_K, _ERRNO | errno.ENOSYS, None, None),
        "skip",  # returns 0 without running the call
        (_RET_K, _ERRNO | 0, None, None),
        "allow",
        (_RET_K, _ALLOW, None, None),
    ]
    labels, instructions = {}, []
    for entry in program:
        if isinstance(entry, str):
            labels[entry] = len(instructions)
        else:
            instructions.append(entry)
    out = []
    for i, (code, k, if_true, if_false) in enumerate(instructions):
        jt = labels[if_true] - i - 1 if if_true else 0
        jf = labels[if_false] - i - 1 if if_false else 0
        out.append(struct.pack("HBBI", code, jt, jf, k))
    return b"".join(out)


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def install(program: bytes) -> None:
    """Apply ``program`` to this process and everything it starts; needs no_new_privs first."""
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _Program(len(program) // 8, ctypes.addressof(buffer))
    prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.addressof(fprog))
