"""The seccomp filter every call runs under: the few kernel interfaces that reach past the
call's namespaces, or between calls, are refused with EPERM.

- Sockets of any family but IPv4, IPv6 and netlink. Those three live in the call's own empty
  network namespace; others do not: a unix socket file in a directory the call can see (even
  on a read-only mount) or an abstract unix name would connect to a host process, and vsock
  reaches the hypervisor. ``socketpair`` stays allowed (asyncio and ``multiprocessing`` pipes
  use it; it connects to nothing).
- New namespaces (``unshare``, and ``clone`` with a ``CLONE_NEW*`` flag): an unprivileged
  process may create a user namespace, in which it is root with every capability: it could
  mount cgroup and other filesystems, configure network devices and reach netfilter, the usual
  start of kernel exploits from containers. ``clone3`` passes its flags in memory that a
  filter cannot read, so it fails with ENOSYS, on which the C library falls back to ``clone``
  (as it does on kernels older than 5.3).
- The kernel keyrings (``add_key``, ``request_key``, ``keyctl``): a slot uid's keyring outlives
  its call and is shared by every call that runs as that uid.
- ``flock``: a lock on a file of the installation (which every call and the trainer can open)
  would block, or signal to, calls of other templates.
- ``inotify``: a watch on the installation's directories shows which files other calls and the
  trainer open.
- ``io_uring``, which performs socket operations without passing through this filter.
- Any syscall of another ABI (32-bit ``int 0x80`` or x32 on x86_64), whose numbers this
  filter does not check.

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
    "x86_64": dict(arch=0xC000003E, socket=41, clone=56, unshare=272, refused=(
        248, 249, 250,  # add_key, request_key, keyctl
        73,  # flock
        253, 294,  # inotify_init, inotify_init1
    )),
    "aarch64": dict(arch=0xC00000B7, socket=198, clone=220, unshare=97, refused=(
        217, 218, 219,  # add_key, request_key, keyctl
        32,  # flock
        26,  # inotify_init1
    )),
}
_IO_URING = (425, 426, 427)  # setup, enter, register: one number on every architecture
_CLONE3 = 435  # one number on every architecture
_X32_SYSCALL_BIT = 0x40000000
_ALLOWED_FAMILIES = (2, 10, 16)  # AF_INET, AF_INET6, AF_NETLINK
# CLONE_NEWTIME, NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_NEW_NAMESPACE_FLAGS = 0x80 | 0x20000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

_LD_W_ABS, _JEQ_K, _JGE_K, _JSET_K, _RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16 if sys.byteorder == "little" else 20


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
        *[(_JEQ_K, nr, "deny", None) for nr in abi["refused"] + _IO_URING],
        (_JEQ_K, _CLONE3, "enosys", None),
        (_JEQ_K, abi["clone"], "namespaces", None),
        (_JEQ_K, abi["unshare"], "namespaces", None),
        (_JEQ_K, abi["socket"], "socket", "allow"),
        "namespaces",
        (_LD_W_ABS, _ARG0_LOW, None, None),
        (_JSET_K, _NEW_NAMESPACE_FLAGS, "deny", "allow"),
        "socket",
        (_LD_W_ABS, _ARG0_LOW, None, None),
        *[(_JEQ_K, family, "allow", None) for family in _ALLOWED_FAMILIES],
        "deny",
        (_RET_K, _ERRNO | errno.EPERM, None, None),
        "enosys",
        (_RET_K, _ERRNO | errno.ENOSYS, None, None),
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
