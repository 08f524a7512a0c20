"""The seccomp filter every call runs under: the few kernel interfaces that reach past the
call's namespaces are refused with EPERM.

- Sockets of any family but IPv4, IPv6 and netlink. Those three live in the template's empty
  network namespace; others do not: a unix socket file in a directory the call can see (even
  on a read-only mount) or an abstract unix name would connect to a host process, and vsock
  reaches the hypervisor. ``socketpair`` stays allowed (asyncio and ``multiprocessing`` pipes
  use it; it connects to nothing).
- The kernel keyrings (``add_key``, ``request_key``, ``keyctl``): a slot uid's keyring outlives
  its call and is shared by every call that runs as that uid.
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

# machine: (AUDIT_ARCH_*, socket, add_key, request_key, keyctl)
_ABIS = {
    "x86_64": (0xC000003E, 41, 248, 249, 250),
    "aarch64": (0xC00000B7, 198, 217, 218, 219),
}
_IO_URING = (425, 426, 427)  # setup, enter, register: one number on every architecture
_X32_SYSCALL_BIT = 0x40000000
_ALLOWED_FAMILIES = (2, 10, 16)  # AF_INET, AF_INET6, AF_NETLINK

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_NR, _ARCH, _ARG0_LOW = 0, 4, 16 if sys.byteorder == "little" else 20


def call_filter() -> bytes | None:
    """The classic-BPF program (``struct sock_filter`` array) for this machine, or None."""
    abi = _ABIS.get(os.uname().machine)
    if abi is None:
        return None
    arch, socket_nr, *keyring_nrs = abi
    denied = list(keyring_nrs) + list(_IO_URING)
    # (opcode, k, jump-if-true label, jump-if-false label); labels resolve to offsets below.
    program = [
        (_LD_W_ABS, _ARCH, None, None),
        (_JEQ_K, arch, None, "deny"),
        (_LD_W_ABS, _NR, None, None),
        (_JGE_K, _X32_SYSCALL_BIT, "deny", None),
        *[(_JEQ_K, nr, "deny", None) for nr in denied],
        (_JEQ_K, socket_nr, None, "allow"),
        (_LD_W_ABS, _ARG0_LOW, None, None),
        *[(_JEQ_K, family, "allow", None) for family in _ALLOWED_FAMILIES],
        ("deny", _RET_K, _ERRNO | errno.EPERM),
        ("allow", _RET_K, _ALLOW),
    ]
    labels = {ins[0]: i for i, ins in enumerate(program) if isinstance(ins[0], str)}
    out = []
    for i, ins in enumerate(program):
        if isinstance(ins[0], str):
            out.append(struct.pack("HBBI", ins[1], 0, 0, ins[2]))
            continue
        code, k, if_true, if_false = ins
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
