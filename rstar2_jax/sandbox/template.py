"""A template process: a warm, single-threaded, JAX-free interpreter that forks one child per call.

Started by the pool as ``python -m rstar2_jax.sandbox.template <in_fd> <out_fd> <worker>
<uid_base> <config-json>`` with BLAS threads pinned to 1. It imports and exercises the usual
math modules once, so a forked call starts warm (~3 ms instead of ~0.4 s for a fresh
interpreter that imports numpy and sympy), then serves requests from its channel.

Up to ``slots_per_worker`` calls run at once; one ``poll`` loop watches every call's stdout,
stderr and pidfd and the nearest deadline, so a sleeping call never blocks the others. A call
ends when its process exits (pidfd) or its deadline passes, never on pipe EOF: a grandchild
holding stdout open cannot stall it.

Channel protocol (length-prefixed JSON via ``multiprocess.connection``; nothing is pickled):
  pool -> template: {"op": "run", "id": int, "code": str, "stdin": str} | {"op": "shutdown"}
  template -> pool: {"op": "ready", "level": str, "pid": int}
                    | {"op": "result", "id": int, "result": ExecResult.to_dict()}
                    | {"op": "fatal", "error": str}
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import json
import os
import select
import shutil
import signal
import sys
import tempfile
import time

from multiprocess.connection import Connection

from rstar2_jax.sandbox import containment, runner
from rstar2_jax.sandbox.config import SandboxConfig
from rstar2_jax.sandbox.result import ExecResult, sandbox_error

_READ_CHUNK = 1 << 16
_LAUNCHES_PER_TURN = 4


def _has_exited(pid: int) -> bool:
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def warm_up() -> None:
    """Import and exercise what math tool calls use, so forked children find it ready."""
    import bisect, cmath, collections, decimal, fractions, functools, heapq, itertools  # noqa: E401,F401
    import math, random, re, statistics, string  # noqa: E401,F401
    import numpy as np
    import sympy as sp

    a = np.arange(9.0).reshape(3, 3) + np.eye(3)
    np.linalg.eigvals(a), np.linalg.solve(a, np.ones(3)), np.linalg.det(a)
    # numpy 2 imports these submodules lazily (~20 ms for numpy.random); children reseed it.
    np.random.seed(0), np.random.rand(), np.fft.fft(np.ones(4)), np.polynomial.Polynomial([1, 2])(3)
    x, y = sp.symbols("x y")
    # The first simplify/solve in a process costs ~150 ms of caches; pay it once here.
    sp.simplify(sp.sin(x) ** 2 + sp.cos(x) ** 2)
    sp.solve([x + y - 3, x - y - 1], [x, y])
    sp.factorint(360), sp.isprime(97), sp.integrate(x ** 2, x), sp.Rational(1, 3) + sp.Rational(1, 6)
    fractions.Fraction(1, 3) + fractions.Fraction(1, 6), math.comb(10, 3)
    list(itertools.permutations(range(4)))
    statistics.mean([1, 2, 3])
    try:
        raise ValueError("warm the traceback path")
    except ValueError as exc:
        import io, traceback
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=io.StringIO())


@dataclasses.dataclass
class _Call:
    id: int
    slot: int
    pid: int
    pidfd: int
    out_fd: int
    err_fd: int
    status_fd: int
    start: float
    deadline: float
    scratch: str | None
    out: bytearray = dataclasses.field(default_factory=bytearray)
    err: bytearray = dataclasses.field(default_factory=bytearray)
    out_truncated: bool = False
    err_truncated: bool = False
    forced: str | None = None  # "timeout" or "output_limit" once the template killed it


class Template:
    def __init__(self, conn_in: Connection, conn_out: Connection, config: SandboxConfig,
                 worker: int, uid_base: int, level: str):
        self.conn_in, self.conn_out = conn_in, conn_out
        self.config, self.level = config, level
        self.uids = [uid_base + worker * config.slots_per_worker + s for s in range(config.slots_per_worker)]
        self.free_slots = list(range(config.slots_per_worker))
        self.pending: collections.deque[dict] = collections.deque()
        self.calls: dict[int, _Call] = {}  # by pidfd
        self.fd_owner: dict[int, tuple[_Call, str]] = {}
        self.poller = select.poll()
        self.poller.register(conn_in.fileno(), select.POLLIN)
        self.orig_pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.scratch_root = None
        if level != "namespaces":
            self.scratch_root = tempfile.mkdtemp(prefix="rstar2-sandbox-")
            os.chmod(self.scratch_root, 0o711)  # slot uids may enter their own subdirectory only
        self.running = True

    # -- calls -------------------------------------------------------------------------------
    def launch(self, request: dict) -> None:
        """Fork the call's child. If the host refuses (no fds, no memory, fork limit), the call
        resolves as ``sandbox_error`` and the template keeps serving."""
        slot = self.free_slots.pop()
        uid = self.uids[slot]
        opened: list[int] = []
        scratch = None
        try:
            stdin_fd = os.memfd_create("stdin", os.MFD_CLOEXEC)
            opened.append(stdin_fd)
            os.write(stdin_fd, request["stdin"].encode("utf-8", errors="surrogateescape"))
            os.lseek(stdin_fd, 0, os.SEEK_SET)
            (out_r, out_w), (err_r, err_w), (st_r, st_w) = (os.pipe2(os.O_CLOEXEC) for _ in range(3))
            opened += [out_r, out_w, err_r, err_w, st_r, st_w]
            if self.scratch_root is not None:
                scratch = os.path.join(self.scratch_root, f"{request['id']}")
                os.mkdir(scratch, 0o700)
                if self.level == "uid":
                    os.chown(scratch, uid, uid)
            pid = self._fork(request["code"], stdin_fd, out_w, err_w, st_w, uid, scratch)
            start = time.monotonic()
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise
        except OSError as exc:
            for fd in opened:
                os.close(fd)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            self.free_slots.append(slot)
            self.send({"op": "result", "id": request["id"],
                       "result": sandbox_error(f"could not start the call: {exc}").to_dict()})
            return
        for fd in (stdin_fd, out_w, err_w, st_w):
            os.close(fd)
        for fd in (out_r, err_r, st_r):
            os.set_blocking(fd, False)
        call = _Call(request["id"], slot, pid, pidfd, out_r, err_r, st_r, start,
                     start + self.config.timeout_s, scratch)
        self.calls[pidfd] = call
        for fd, kind in ((out_r, "out"), (err_r, "err"), (pidfd, "exit")):
            self.fd_owner[fd] = (call, kind)
            self.poller.register(fd, select.POLLIN)

    def _fork(self, code: str, stdin_fd: int, out_w: int, err_w: int, st_w: int, uid: int,
              scratch: str | None) -> int:
        if self.level == "namespaces":
            # New PID namespace for the next child only; switched back right after the fork.
            containment.unshare(containment.CLONE_NEWPID)
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    runner.child_main(code, stdin_fd, out_w, err_w, st_w, self.config, self.level, uid, scratch)
                finally:  # the child must never fall back into the template's loop
                    os._exit(1)
        finally:
            if self.level == "namespaces":
                containment.setns(self.orig_pidns, containment.CLONE_NEWPID)
        return pid

    def read_stream(self, call: _Call, kind: str) -> None:
        """Read what is available (non-blocking); kill the call if it passes the byte cap."""
        fd, buf = (call.out_fd, call.out) if kind == "out" else (call.err_fd, call.err)
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                return
            if not chunk:
                self.poller.unregister(fd)
                self.fd_owner.pop(fd, None)
                return
            room = self.config.output_limit_bytes - len(buf)
            buf += chunk[:room]
            if len(chunk) > room:
                if kind == "out":
                    call.out_truncated = True
                else:
                    call.err_truncated = True
                self.kill(call, "output_limit")
                return

    def kill(self, call: _Call, reason: str) -> None:
        if call.forced is None:
            call.forced = reason
        # namespaces: the call is PID 1 of its namespace, so this kills everything it started.
        os.kill(call.pid, signal.SIGKILL)
        self.sweep(call)

    def sweep(self, call: _Call) -> None:
        """Kill what the call left behind (levels without a PID namespace)."""
        if self.level == "uid":
            containment.kill_uid(self.uids[call.slot])
        elif self.level == "none":
            try:
                os.killpg(call.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            # Orphans of the call were reparented to us (child subreaper): kill and reap them.
            live = {c.pid for c in self.calls.values()}
            for pid in containment.children_of(os.getpid()):
                if pid not in live:
                    try:
                        os.kill(pid, signal.SIGKILL)
                        os.waitpid(pid, 0)
                    except (ProcessLookupError, ChildProcessError):
                        pass

    def finish(self, call: _Call) -> None:
        _, wait_status, rusage = os.wait4(call.pid, 0)
        wall = time.monotonic() - call.start
        self.sweep(call)
        for kind, fd in (("out", call.out_fd), ("err", call.err_fd)):
            if fd in self.fd_owner:
                self.read_stream(call, kind)
        try:
            tag = os.read(call.status_fd, 64)
        except BlockingIOError:
            tag = b""
        for fd in (call.out_fd, call.err_fd, call.pidfd):
            if fd in self.fd_owner:
                self.poller.unregister(fd)
                del self.fd_owner[fd]
        for fd in (call.out_fd, call.err_fd, call.status_fd, call.pidfd):
            os.close(fd)
        del self.calls[call.pidfd]
        if call.scratch is not None:
            shutil.rmtree(call.scratch, ignore_errors=True)
        self.free_slots.append(call.slot)
        result = self.classify(call, wait_status, tag, wall, rusage.ru_utime + rusage.ru_stime)
        self.send({"op": "result", "id": call.id, "result": result.to_dict()})

    def classify(self, call: _Call, wait_status: int, tag: bytes, wall: float, cpu: float) -> ExecResult:
        exit_code = os.waitstatus_to_exitcode(wait_status)
        sig = -exit_code if exit_code < 0 else None
        status, detail = "error", ""
        if call.forced == "timeout":
            status, detail = "timeout", f"exceeded the {self.config.timeout_s:g} s wall-clock limit"
        elif call.forced == "output_limit":
            status, detail = "output_limit", f"more than {self.config.output_limit_bytes} bytes on one stream"
        elif tag == runner.STATUS_SETUP_FAILED:
            status, detail = "sandbox_error", "call setup failed"
        elif sig == signal.SIGXCPU:
            status, detail = "timeout", f"exceeded the {self.config.cpu_limit_s} s CPU-time limit"
        elif sig is not None:
            status = "killed"
        elif tag == runner.STATUS_MEMORY:
            status = "memory"
        elif exit_code == 0:
            status = "ok"
        return ExecResult(
            status=status,
            stdout=call.out.decode("utf-8", errors="replace"),
            stderr=call.err.decode("utf-8", errors="replace"),
            wall_s=wall, cpu_s=cpu,
            exit_code=None if sig is not None else exit_code, signal=sig,
            stdout_truncated=call.out_truncated, stderr_truncated=call.err_truncated,
            detail=detail)

    # -- channel -----------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        self.conn_out.send_bytes(json.dumps(message).encode())

    def receive(self) -> None:
        while self.running and self.conn_in.poll(0):
            try:
                message = json.loads(self.conn_in.recv_bytes())
            except (EOFError, OSError):  # the pool is gone: stop, killing our calls
                self.running = False
                return
            if message["op"] == "shutdown":
                self.running = False
            else:
                self.pending.append(message)

    def serve(self) -> None:
        while self.running:
            # A few launches per turn: forks are slow on a loaded host and calls already running
            # must have their exits and output handled meanwhile.
            for _ in range(min(_LAUNCHES_PER_TURN, len(self.pending), len(self.free_slots))):
                self.launch(self.pending.popleft())
            deadlines = [c.deadline for c in self.calls.values() if c.forced is None]
            if self.pending and self.free_slots:
                timeout_ms = 0
            elif deadlines:
                timeout_ms = max(0, int((min(deadlines) - time.monotonic()) * 1000) + 1)
            else:
                timeout_ms = None
            for fd, _ in self.poller.poll(timeout_ms):
                if fd == self.conn_in.fileno():
                    self.receive()
                    continue
                owner = self.fd_owner.get(fd)
                if owner is None:
                    continue  # already finished earlier in this batch of events
                call, kind = owner
                if kind == "exit":
                    self.finish(call)
                else:
                    self.read_stream(call, kind)
            now = time.monotonic()
            for call in list(self.calls.values()):
                # A call that exited before its deadline is finished on its pidfd event, not
                # killed: however late we look, it did not time out.
                if call.forced is None and now >= call.deadline and not _has_exited(call.pid):
                    self.kill(call, "timeout")
        for call in list(self.calls.values()):
            os.kill(call.pid, signal.SIGKILL)
            self.sweep(call)
            os.waitpid(call.pid, 0)
        if self.scratch_root is not None:
            shutil.rmtree(self.scratch_root, ignore_errors=True)


def choose_level(requested: str) -> str:
    """Set up the strongest isolation allowed (or the requested one); return its name."""
    if requested in ("auto", "namespaces"):
        try:
            containment.setup_template_namespaces()
            fd = os.open("/proc/self/ns/pid", os.O_RDONLY)
            containment.probe_pid_namespace(fd)
            os.close(fd)
            return "namespaces"
        except OSError:
            if requested == "namespaces":
                raise
    if requested in ("auto", "uid") and os.geteuid() == 0:
        return "uid"
    if requested == "uid":
        raise PermissionError("isolation='uid' needs root to switch to slot uids")
    containment.prctl(containment.PR_SET_CHILD_SUBREAPER, 1)
    return "none"


def main(argv: list[str]) -> None:
    in_fd, out_fd, worker, uid_base = map(int, argv[:4])
    config = SandboxConfig.from_json(argv[4])
    conn_in = Connection(in_fd, writable=False)
    conn_out = Connection(out_fd, readable=False)
    try:
        if "jax" in sys.modules:
            raise RuntimeError("the sandbox template imported jax; templates must stay JAX-free")
        warm_up()
        level = choose_level(config.isolation)
        template = Template(conn_in, conn_out, config, worker, uid_base, level)
    except BaseException as exc:
        conn_out.send_bytes(json.dumps({"op": "fatal", "error": repr(exc)}).encode())
        raise
    # Everything allocated so far is shared with every child: keep the collector from touching
    # (and so copying) those pages in each fork.
    gc.freeze()
    template.send({"op": "ready", "level": level, "pid": os.getpid()})
    template.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
