"""The zygote: the warm, clean process that every call of a template is forked from.

The template holds every call's code, input and output and the channel to the pool. If calls
were forked from it, each would hold a copy of all that (reachable through its frames, or by
reading its own memory). So the template forks the zygote once, after warming up and before it
has seen any call, and the zygote forks the calls. It never reads a call's code or input: for
each call it receives descriptors (memfds holding the code and stdin, the write ends of the
stdout, stderr and ready pipes), forks the call's child with them and hands back a pidfd; when
the child exits it reaps it and reports the wait status and CPU time. A call's memory thus holds
the warm interpreter, its own code and a few integers (ids, pids, descriptor numbers) of the
zygote's bookkeeping; no other call's data, no descriptor of the template.

Protocol over a SOCK_SEQPACKET pair (JSON; descriptors as SCM_RIGHTS):
  template -> zygote: {"id", "slot", "scratch"} + [code, stdin, stdout, stderr, ready]
  zygote -> template: {"id", "start"} + [pidfd] | {"id", "error"} | {"id", "exit", "cpu"}
"""
from __future__ import annotations

import array
import dataclasses
import gc
import json
import os
import select
import signal
import socket
import time

from rstar2_jax.sandbox import containment, runner
from rstar2_jax.sandbox.config import SandboxConfig

_FDS_PER_CALL = 5


@dataclasses.dataclass(frozen=True)
class CallSpec:
    """What every call's child needs besides its descriptors (see ``runner.child_main``).

    Attributes:
      uids: the slot uids, by slot.
      cgroup_procs: per slot, a descriptor of ``cgroup.procs`` of each of its cgroups (one per
        hierarchy; none where the template may not create cgroups).
      rebind: installation paths under the scratch mount point, bound back per call.
      seccomp_filter: the BPF program of ``seccomp.call_filter``; None on other architectures.
      pidns_fd: descriptor of the zygote's own PID namespace (``namespaces`` level).
      netns_fds: per slot, a descriptor of its network namespace (``namespaces`` level).
    """

    config: SandboxConfig
    level: str
    uids: tuple[int, ...]
    cgroup_procs: tuple[tuple[int, ...], ...]
    rebind: tuple[str, ...]
    seccomp_filter: bytes | None
    pidns_fd: int | None
    netns_fds: tuple[int, ...]


def receive(sock: socket.socket, max_fds: int, flags: int = 0) -> tuple[bytes, list[int]]:
    """One message and the descriptors it carries (``socket.recv_fds`` ignores ``flags``)."""
    fds = array.array("i")
    message, ancdata, _, _ = sock.recvmsg(1 << 16, socket.CMSG_LEN(max_fds * fds.itemsize), flags)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    return message, list(fds)


def start(spec: CallSpec, close_fds: list[int]) -> tuple[int, socket.socket]:
    """Fork the zygote (closing ``close_fds`` in it); return its pid and the template's end."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            ours.close()
            for fd in close_fds:
                os.close(fd)
            Zygote(theirs, spec).serve()
            status = 0
        finally:  # never fall back into the template's code
            os._exit(status)
    theirs.close()
    return pid, ours


class Zygote:
    def __init__(self, sock: socket.socket, spec: CallSpec):
        self.sock, self.spec = sock, spec
        self.children: dict[int, tuple[int, int]] = {}  # pidfd -> (call id, pid)
        self.poller = select.poll()
        self.poller.register(sock.fileno(), select.POLLIN)

    def send(self, message: dict, fds: list[int] = ()) -> None:
        socket.send_fds(self.sock, [json.dumps(message).encode()], list(fds))

    def serve(self) -> None:
        containment.prctl(containment.PR_SET_PDEATHSIG, signal.SIGKILL)
        if self.spec.level == "none":
            # Orphans of a call are reparented here, so that they can be found and killed.
            containment.prctl(containment.PR_SET_CHILD_SUBREAPER, 1)
        # Everything allocated so far is shared with every call: keep the collector from
        # touching (and so copying) those pages in each fork.
        gc.freeze()
        while True:
            for fd, _ in self.poller.poll():
                if fd != self.sock.fileno():
                    self.reap(fd)
                    continue
                message, fds = receive(self.sock, _FDS_PER_CALL)
                if not message:  # the template closed its end: stop
                    self.shutdown()
                    return
                self.launch(json.loads(message), fds)

    def launch(self, request: dict, fds: list[int]) -> None:
        code_fd, stdin_fd, out_w, err_w, ready_w = fds
        namespaces = self.spec.level == "namespaces"
        try:
            if namespaces:
                # A new PID namespace for the next child only; switched back right after the fork.
                containment.unshare(containment.CLONE_NEWPID)
            start = time.monotonic()
            try:
                pid = os.fork()
                if pid == 0:
                    try:
                        runner.child_main(self.spec, request["slot"], request["scratch"], code_fd, stdin_fd,
                                          out_w, err_w, ready_w)
                    finally:  # the child must never fall back into the zygote's loop
                        os._exit(1)
            finally:
                if namespaces:
                    containment.setns(self.spec.pidns_fd, containment.CLONE_NEWPID)
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
        except OSError as exc:  # the host refused (no memory, fork limit): this call fails alone
            self.send({"id": request["id"], "error": str(exc)})
            return
        finally:
            for fd in fds:
                os.close(fd)
        self.children[pidfd] = (request["id"], pid)
        self.poller.register(pidfd, select.POLLIN)
        self.send({"id": request["id"], "start": start}, [pidfd])

    def reap(self, pidfd: int) -> None:
        call_id, pid = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status, rusage = os.wait4(pid, 0)
        self.sweep(pid)
        self.send({"id": call_id, "exit": status, "cpu": rusage.ru_utime + rusage.ru_stime})

    def sweep(self, pid: int) -> None:
        """Kill what a call left behind (``none`` level: no PID namespace, no uid of its own)."""
        if self.spec.level != "none":
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        live = {p for _, p in self.children.values()}
        for orphan in containment.children_of(os.getpid()):
            if orphan not in live:
                try:
                    os.kill(orphan, signal.SIGKILL)
                    os.waitpid(orphan, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass

    def shutdown(self) -> None:
        for pidfd, (_, pid) in list(self.children.items()):
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(pid, 0)
            self.sweep(pid)
