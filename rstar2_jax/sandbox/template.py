"""A template process: a warm, single-threaded, JAX-free interpreter that supervises the calls
of one worker of the pool.

Started by the pool as ``python -P -m rstar2_jax.sandbox.template <in_fd> <out_fd> <worker>
<num_workers> <uid_base> <config-json>`` with an environment built from scratch (``pool``). It imports and
exercises the usual math modules once, sets up its containment (cgroups, namespaces, the
minimal root), then forks the zygote (``zygote``): a warm copy that has seen no call, from which
every call is forked (~3 ms instead of ~0.4 s for a fresh interpreter that imports numpy and
sympy). The template itself never forks a call, so nothing it holds is in any call's memory.

Up to ``slots_per_worker`` calls run at once; one ``poll`` loop watches every call's stdout and
stderr, the zygote's reports and the nearest deadline, so a sleeping call never blocks the
others. A call ends when its process exits (reaped by the zygote) or its deadline passes, never
on pipe EOF: a grandchild holding stdout open cannot stall it.

Channel protocol (length-prefixed JSON via ``multiprocess.connection``; nothing is pickled):
  pool -> template: {"op": "run", "id": int, "code": str, "stdin": str,
                    "replay": [[code, stdin], ...], "seed": int | null} | {"op": "shutdown"}
  template -> pool: {"op": "ready", "level": str, "memory": str, "cpu": str, "pid": int}
                    | {"op": "result", "id": int, "result": ExecResult.to_dict()}
                    | {"op": "fatal", "error": str}
"""
from __future__ import annotations

import collections
import dataclasses
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time

from multiprocess.connection import Connection

import rstar2_jax
from rstar2_jax.sandbox import containment, filesystem, runner, seccomp, zygote
from rstar2_jax.sandbox.cgroup import SlotCgroups
from rstar2_jax.sandbox.config import SandboxConfig
from rstar2_jax.sandbox.result import ExecResult, sandbox_error

_READ_CHUNK = 1 << 16
# Calls handed to the zygote and not yet forked. Few, so that the template never blocks on the
# zygote's socket (whose queue holds 10 messages) and keeps killing calls at their deadline
# while the zygote forks: forks are slow on a loaded host.
_STARTING_MAX = 4
# A stream that delivered less than _QUIET_BYTES in one wakeup is not watched again for
# _QUIET_S: a call writing a byte at a time would otherwise wake the template (outside the
# call's CPU cgroup) for every byte. The call's exit is reported by the zygote, and what is left
# in its pipes is read then, so this delays no result.
_QUIET_BYTES = 4096
_QUIET_S = 0.01


def _has_exited(pidfd: int) -> bool:
    return bool(select.select([pidfd], [], [], 0)[0])


def _ends_with_memory_error(stderr: str) -> bool:
    """Whether the last line of ``stderr`` is an uncaught MemoryError (or a subclass such as
    numpy's), as the runner prints it: what the call itself says, not what the kernel saw."""
    exception = stderr.rstrip("\n").rpartition("\n")[2].partition(":")[0]
    return exception.endswith("MemoryError") and " " not in exception


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd


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
    out_fd: int
    err_fd: int
    ready_fd: int
    scratch: str | None
    oom_kills: int  # the slot cgroup's count when the call started
    pidfd: int | None = None  # known once the zygote has forked it
    start: float = 0.0
    deadline: float = float("inf")
    out: bytearray = dataclasses.field(default_factory=bytearray)
    err: bytearray = dataclasses.field(default_factory=bytearray)
    out_truncated: bool = False
    err_truncated: bool = False
    forced: str | None = None  # "timeout" or "output_limit" once the template killed it


class Template:
    def __init__(self, conn_in: Connection, conn_out: Connection, spec: zygote.CallSpec,
                 cgroups: SlotCgroups):
        self.conn_in, self.conn_out = conn_in, conn_out
        self.spec, self.config, self.level, self.cgroups = spec, spec.config, spec.level, cgroups
        self.free_slots = list(range(self.config.slots_per_worker))
        self.pending: collections.deque[dict] = collections.deque()
        self.calls: dict[int, _Call] = {}  # by call id
        self.fd_owner: dict[int, tuple[_Call, str]] = {}
        self.quiet: dict[int, float] = {}  # stream fd -> when it is watched again (monotonic)
        self.scratch_root = None
        if self.level != "namespaces":
            self.scratch_root = tempfile.mkdtemp(prefix="rstar2-sandbox-")
            os.chmod(self.scratch_root, 0o711)  # slot uids may enter their own subdirectory only
        self.zygote_pid, self.zygote = zygote.start(spec, [conn_in.fileno(), conn_out.fileno()])
        self.poller = select.poll()
        self.poller.register(conn_in.fileno(), select.POLLIN)
        self.poller.register(self.zygote.fileno(), select.POLLIN)
        self.running = True

    # -- calls -------------------------------------------------------------------------------
    def launch(self, request: dict) -> None:
        """Hand the call to the zygote. A call that cannot start (stdin that is not text, the
        host out of descriptors or memory) resolves alone; the template keeps serving."""
        try:
            stdin = request["stdin"].encode("utf-8")
        except UnicodeEncodeError as exc:
            self.send_result(request["id"], ExecResult(
                status="error", stderr=f"the call's stdin is not valid text: {exc}\n",
                detail="stdin holds a lone surrogate code point, which no program can read"))
            return
        slot = self.free_slots.pop()
        opened: list[int] = []
        scratch = None
        try:
            # The call's program: its code, the session's cells to replay first and their seed
            # (``runner.Program``). JSON keeps lone surrogates in the code: compiling it then
            # fails in the call with Python's own message, as it would for any program.
            program = {"code": request["code"], "replay": request.get("replay", []), "seed": request.get("seed")}
            opened.append(_memfd("program", json.dumps(program).encode()))
            opened.append(_memfd("stdin", stdin))
            (out_r, out_w), (err_r, err_w), (ready_r, ready_w) = (os.pipe2(os.O_CLOEXEC) for _ in range(3))
            opened += [out_w, err_w, ready_w, out_r, err_r, ready_r]
            if self.scratch_root is not None:
                scratch = os.path.join(self.scratch_root, f"{request['id']}")
                os.mkdir(scratch, 0o700)
                if self.level == "uid":
                    os.chown(scratch, self.spec.uids[slot], self.spec.uids[slot])
            oom_kills = self.cgroups.oom_kills(slot)
            message = {"id": request["id"], "slot": slot, "scratch": scratch}
            socket.send_fds(self.zygote, [json.dumps(message).encode()], opened[:5])
        except OSError as exc:
            for fd in opened:
                os.close(fd)
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
            self.free_slots.append(slot)
            self.send_result(request["id"], sandbox_error(f"could not start the call: {exc}"))
            return
        for fd in opened[:5]:
            os.close(fd)
        for fd in (out_r, err_r, ready_r):
            os.set_blocking(fd, False)
        call = _Call(request["id"], slot, out_r, err_r, ready_r, scratch, oom_kills)
        self.calls[call.id] = call
        for fd, kind in ((out_r, "out"), (err_r, "err")):
            self.fd_owner[fd] = (call, kind)
            self.poller.register(fd, select.POLLIN)

    def on_zygote(self) -> None:
        """Handle every report the zygote has sent so far."""
        while True:
            try:
                message, fds = zygote.receive(self.zygote, 1, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not message:
                raise RuntimeError("the zygote died")
            self.on_report(json.loads(message), fds)

    def on_report(self, message: dict, fds: list[int]) -> None:
        call = self.calls[message["id"]]
        if "start" in message:
            call.pidfd, call.start = fds[0], message["start"]
            call.deadline = call.start + self.config.timeout_s
            if call.forced is not None:  # its output passed the cap before its pid arrived
                self.kill(call, call.forced)
        elif "error" in message:
            self.release(call)
            self.send_result(call.id, sandbox_error(f"could not start the call: {message['error']}"))
        else:
            self.finish(call, message["exit"], message["cpu"])

    def read_stream(self, call: _Call, kind: str) -> None:
        """Read what is available (non-blocking); kill the call if it passes the byte cap."""
        fd, buf = (call.out_fd, call.out) if kind == "out" else (call.err_fd, call.err)
        received = 0
        while True:
            try:
                chunk = os.read(fd, _READ_CHUNK)
            except BlockingIOError:
                if received < _QUIET_BYTES and fd not in self.quiet:
                    self.poller.modify(fd, 0)  # only hang-ups are reported until then
                    self.quiet[fd] = time.monotonic() + _QUIET_S
                return
            received += len(chunk)
            if not chunk:
                self.poller.unregister(fd)
                self.fd_owner.pop(fd, None)
                self.quiet.pop(fd, None)
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
        if call.pidfd is None:
            return  # killed as soon as the zygote reports its pid
        try:
            # namespaces: the call is PID 1 of its namespace, so this kills everything it started.
            signal.pidfd_send_signal(call.pidfd, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.sweep(call)

    def sweep(self, call: _Call) -> None:
        """``uid`` level: kill every process of the call's slot uid (the zygote sweeps ``none``)."""
        if self.level == "uid":
            containment.kill_uid(self.spec.uids[call.slot])

    def release(self, call: _Call) -> None:
        """Close the call's descriptors and free its slot."""
        for fd in (call.out_fd, call.err_fd):
            self.quiet.pop(fd, None)
            if fd in self.fd_owner:
                self.poller.unregister(fd)
                del self.fd_owner[fd]
        for fd in (call.out_fd, call.err_fd, call.ready_fd, call.pidfd):
            if fd is not None:
                os.close(fd)
        del self.calls[call.id]
        if call.scratch is not None:
            shutil.rmtree(call.scratch, ignore_errors=True)
        self.free_slots.append(call.slot)

    def finish(self, call: _Call, wait_status: int, cpu: float) -> None:
        wall = time.monotonic() - call.start
        self.sweep(call)
        for kind, fd in (("out", call.out_fd), ("err", call.err_fd)):
            if fd in self.fd_owner:
                self.read_stream(call, kind)
        try:
            ready = os.read(call.ready_fd, len(runner.READY))
        except BlockingIOError:
            ready = b""
        oom = self.cgroups.oom_kills(call.slot) > call.oom_kills
        self.release(call)
        self.send_result(call.id, self.classify(call, wait_status, ready == runner.READY, oom, wall, cpu))

    def classify(self, call: _Call, wait_status: int, ready: bool, oom: bool, wall: float,
                 cpu: float) -> ExecResult:
        exit_code = os.waitstatus_to_exitcode(wait_status)
        sig = -exit_code if exit_code < 0 else None
        stderr = call.err.decode("utf-8", errors="replace")
        status, detail = "error", ""
        if oom:  # the kernel's word; the call may have hit its deadline or cap while dying
            status = "memory"
            detail = f"its processes together exceeded the {self.config.memory_bytes}-byte memory limit"
        elif call.forced == "timeout":
            status, detail = "timeout", f"exceeded the {self.config.timeout_s:g} s wall-clock limit"
        elif call.forced == "output_limit":
            status, detail = "output_limit", f"more than {self.config.output_limit_bytes} bytes on one stream"
        elif not ready:
            status, detail = "sandbox_error", "call setup failed"
        elif sig == signal.SIGXCPU:
            status, detail = "timeout", f"exceeded the {self.config.cpu_limit_s} s CPU-time limit"
        elif sig is not None:
            status = "killed"
        elif exit_code == 1 and _ends_with_memory_error(stderr):
            status = "memory"
        elif exit_code == 0:
            status = "ok"
        return ExecResult(
            status=status,
            stdout=call.out.decode("utf-8", errors="replace"),
            stderr=stderr,
            wall_s=wall, cpu_s=cpu,
            exit_code=None if sig is not None else exit_code, signal=sig,
            stdout_truncated=call.out_truncated, stderr_truncated=call.err_truncated,
            detail=detail)

    # -- channel -----------------------------------------------------------------------------
    def send(self, message: dict) -> None:
        self.conn_out.send_bytes(json.dumps(message).encode())

    def send_result(self, call_id: int, result: ExecResult) -> None:
        self.send({"op": "result", "id": call_id, "result": result.to_dict()})

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
        try:
            while self.running:
                self.turn()
        finally:
            for call in list(self.calls.values()):
                self.kill(call, "timeout")
            self.zygote.close()  # the zygote kills and reaps what is left, then exits
            os.waitpid(self.zygote_pid, 0)
            if self.scratch_root is not None:
                shutil.rmtree(self.scratch_root, ignore_errors=True)
            self.cgroups.remove()

    def turn(self) -> None:
        starting = sum(c.pidfd is None for c in self.calls.values())
        for _ in range(min(_STARTING_MAX - starting, len(self.pending), len(self.free_slots))):
            self.launch(self.pending.popleft())
        wake_at = [c.deadline for c in self.calls.values() if c.forced is None and c.pidfd is not None]
        wake_at += self.quiet.values()
        if wake_at:
            timeout_ms = max(0, int((min(wake_at) - time.monotonic()) * 1000) + 1)
        else:
            timeout_ms = None
        for fd, _ in self.poller.poll(timeout_ms):
            if fd == self.conn_in.fileno():
                self.receive()
            elif fd == self.zygote.fileno():
                self.on_zygote()
            elif fd in self.fd_owner:  # else finished earlier in this batch of events
                call, kind = self.fd_owner[fd]
                self.read_stream(call, kind)
        now = time.monotonic()
        for fd, until in list(self.quiet.items()):
            if now >= until:
                del self.quiet[fd]
                self.poller.modify(fd, select.POLLIN)
        for call in list(self.calls.values()):
            # A call that exited before its deadline is finished on the zygote's report, not
            # killed: however late we look, it did not time out.
            if call.forced is None and now >= call.deadline and not _has_exited(call.pidfd):
                self.kill(call, "timeout")


def _enter_namespaces(paths: list[str], slots: int) -> tuple[int, tuple[int, ...]]:
    """``namespaces`` level: private network and mount namespaces, a network namespace per slot,
    the minimal root, and a check that per-call PID namespaces work. Returns descriptors of this
    PID namespace and of the slots' network namespaces. Raises OSError when the kernel refuses."""
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    containment.unshare(containment.CLONE_NEWNS | containment.CLONE_NEWNET)
    slot_netns = tuple(containment.new_network_namespace() for _ in range(slots))
    containment.probe_pid_namespace(pidns)
    filesystem.enter_minimal_root(paths)
    return pidns, slot_netns


def _namespaces_build_here(paths: list[str], slots: int) -> bool:
    """Whether the ``namespaces`` level can be built here, tried in a child.

    A kernel may refuse a step half-way through (a mount in the minimal root, after the pivot):
    trying in this process would leave it in a half-built root with no ``/tmp``, where the
    fallback level cannot start either (seen as root on a Firecracker VM)."""
    pid = os.fork()
    if pid == 0:  # the template is single-threaded and JAX-free, so it may fork
        try:
            _enter_namespaces(paths, slots)
        except BaseException:
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def choose_level(requested: str, paths: list[str], slots: int) -> tuple[str, int | None, tuple[int, ...]]:
    """Set up the strongest isolation allowed (or the requested one) for a call's view of
    ``paths`` (the installation); return its name and, at the ``namespaces`` level, the
    descriptors of this PID namespace and of the ``slots`` network namespaces. ``auto`` tries
    the namespaces in a child first, so a refusal leaves this process as it was."""
    if requested == "namespaces":
        return "namespaces", *_enter_namespaces(paths, slots)
    if requested == "auto":
        if _namespaces_build_here(paths, slots):
            return "namespaces", *_enter_namespaces(paths, slots)
    if requested in ("auto", "uid") and os.geteuid() == 0:
        return "uid", None, ()
    if requested == "uid":
        raise PermissionError("isolation='uid' needs root to switch to slot uids")
    return "none", None, ()


def main(argv: list[str]) -> None:
    in_fd, out_fd, worker, num_workers, uid_base = map(int, argv[:5])
    config = SandboxConfig.from_json(argv[5])
    conn_in = Connection(in_fd, writable=False)
    conn_out = Connection(out_fd, readable=False)
    try:
        if "jax" in sys.modules:
            raise RuntimeError("the sandbox template imported jax; templates must stay JAX-free")
        warm_up()
        paths = []
        if config.isolation in ("auto", "namespaces"):
            # The package's own source checkout is not part of what calls need (and may hold
            # data and checkpoints).
            paths = filesystem.installation_paths(hidden=os.path.dirname(os.path.dirname(rstar2_jax.__file__)))
        # Cgroups first: their filesystem is not part of the minimal root.
        cgroups = SlotCgroups.create(config.slots_per_worker, config.memory_bytes,
                                     config.pool_memory_bytes // num_workers)
        level, pidns, slot_netns = choose_level(config.isolation, paths, config.slots_per_worker)
        uids = tuple(uid_base + worker * config.slots_per_worker + s for s in range(config.slots_per_worker))
        spec = zygote.CallSpec(
            config=config, level=level, uids=uids,
            cgroup_procs=tuple(cgroups.procs_fds),
            rebind=tuple(filesystem.paths_under_scratch(paths)) if level == "namespaces" else (),
            seccomp_filter=seccomp.call_filter(), pidns_fd=pidns, netns_fds=slot_netns)
        template = Template(conn_in, conn_out, spec, cgroups)
    except BaseException as exc:
        conn_out.send_bytes(json.dumps({"op": "fatal", "error": repr(exc)}).encode())
        raise
    template.send({"op": "ready", "level": level, "memory": cgroups.kind("memory") or "rlimit",
                   "cpu": cgroups.kind("cpu") or "none", "pid": os.getpid()})
    template.serve()


if __name__ == "__main__":
    main(sys.argv[1:])
