"""Adversarial suite: hostile or broken tool code against the sandbox, all cases run concurrently.

Each case states the status it must get; afterwards the pools must be healthy, unchanged (no
template died) and, once closed, must leave no process behind. Cases that may time out run in a
pool with a short deadline (TIMEOUT_S); the others in a pool with a long one (PATIENT_TIMEOUT_S),
so that a case starved of CPU by its sixty neighbours (and by other tests on a 2-core machine)
still reaches the status it is there to check instead of the deadline. Nothing here depends on
how fast a loaded machine runs: where a case checks that a call returns without waiting for what
it left running, the bound is PROMPT_S, far below the leftovers' lifetime and the deadline. The pool is started with
what a call must not reach: a secret in the caller's environment, host unix sockets (one in a
directory on PYTHONPATH, so visible to calls, one abstract), a setuid-root binary in that
directory, and a file standing for the training set's answers.

The suite runs twice: as stateless calls, and in session mode, where each hostile call is the
second cell of its own tool session (after a cell that defines some state, so the call replays
it first) and is followed by a third cell, which replays the hostile one: whatever that does to
its session, no other session, call or template may notice.
"""
import ast
import ctypes
import hashlib
import json
import os
import secrets
import select
import shutil
import signal
import socket
import tempfile
import threading
import time

import pytest

from rstar2_jax.sandbox import SandboxPool

TIMEOUT_S = 1.5
PATIENT_TIMEOUT_S = 30.0
PROMPT_S = PATIENT_TIMEOUT_S / 3
OUTPUT_LIMIT = 64 << 10
MEMORY_LIMIT = 512 << 20
VICTIM = f"/var/tmp/rstar2_sandbox_victim_{os.getpid()}"
# Canaries are MARK + 32 hex digits; a call looks for them in its own memory by hash, so the
# code that searches never holds a canary itself. Split so that this file never holds MARK.
MARK = "RSTAR2" + "CANARY"
ENV_SECRET = MARK + secrets.token_hex(16)
CALL_SECRET = MARK + secrets.token_hex(16)
# add_key, keyctl (x86_64, aarch64); the keyring has no libc wrapper
KEY_SYSCALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}[os.uname().machine]


# Defines, inside a call, the paths of its own Python installation (prefixes and sys.path, as
# named and resolved) and the system directories a call may see; a path "leads to" the
# installation if it is one of those paths or one of their ancestors.
INSTALLATION = """import os, sys
installed = set()
for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sys.path}:
    if p and os.path.exists(p):
        installed.update((os.path.abspath(p), os.path.realpath(p)))
SYSTEM = {'/usr', '/bin', '/sbin', '/lib', '/lib32', '/lib64', '/libx32', '/etc/ld.so.cache', '/dev', '/proc', '/tmp'}
def leads_to_installation(path):
    return any(p == path or p.startswith(path + '/') for p in installed | SYSTEM)
"""


def _case(name, code, status, stdin="", check=None, max_wall=None):
    return pytest.param(code, stdin, status, check, max_wall, id=name)


def _stderr_has(text):
    return lambda r: text in r.stderr


CASES = [
    # -- runaway time -----------------------------------------------------------------------
    _case("infinite_loop_python", "while True: pass", "timeout"),
    _case("infinite_loop_in_c", "import itertools\nsum(itertools.repeat(1))", "timeout"),
    _case("bigint_power_in_c", "x = 10 ** (10 ** 10)", "timeout"),
    _case("sleep_past_deadline", "import time\ntime.sleep(100)", "timeout"),
    _case("ignores_sigterm", "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True: pass", "timeout"),
    # Unbounded recursion: it runs until the time limit, or overflows the C stack first (SIGSEGV;
    # which one comes first depends on the interpreter version and the machine's speed).
    _case("deep_python_recursion", "import sys\nsys.setrecursionlimit(10**8)\nf = lambda n: f(n + 1)\nf(0)",
          ("timeout", "killed"), check=lambda r: r.status == "timeout" or r.signal == signal.SIGSEGV),
    _case("blocked_reading_own_pipe", "import os\nr, w = os.pipe()\nos.read(r, 1)", "timeout"),
    # -- processes and threads --------------------------------------------------------------
    # Whether the main process is the first to hit RLIMIT_NPROC (error) or keeps forking until
    # the deadline (timeout) depends on scheduling; either way the tree is contained and killed.
    _case("fork_bomb", "import os\nwhile True:\n    os.fork()", ("error", "timeout"),
          check=_stderr_has("BlockingIOError")),
    _case("thread_bomb", "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,)).start()",
          "error", check=_stderr_has("can't start new thread")),
    # A call returns when its main program ends, whatever it left running (for 100 s, or
    # forever): a call that waited for its leftovers would take the whole PATIENT_TIMEOUT_S.
    _case("setsid_grandchild_holds_stdout",
          "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('parent done')",
          "ok", check=lambda r: r.stdout == "parent done\n", max_wall=PROMPT_S),
    _case("double_fork_daemon",
          "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True: pass\n    os._exit(0)\nprint('ok')",
          "ok", max_wall=PROMPT_S),
    _case("subprocess_left_running", "import subprocess\nsubprocess.Popen(['sleep', '100'])\nprint('spawned')", "ok",
          max_wall=PROMPT_S),
    _case("multiprocessing_pool", "from multiprocessing import Pool\nwith Pool(4) as p:\n    print(sum(p.map(abs, range(-10, 0))))",
          "ok", check=lambda r: r.stdout == "55\n"),
    # The CPU time of four spinning processes over a second of wall time: one CPU at most (plus
    # one period of the quota). On a loaded machine they get less; never more (see also
    # test_a_call_and_its_sessions_share_one_cpu_cgroup).
    _case("all_processes_together_get_one_cpu_at_most",
          "import os, signal, time\npids = []\nstart = time.monotonic()\nfor _ in range(4):\n    pid = os.fork()\n"
          "    if pid == 0:\n        os.setsid()\n        while True: pass\n    pids.append(pid)\n"
          "time.sleep(1.0)\nfor pid in pids:\n    os.kill(pid, signal.SIGKILL)\nwall = time.monotonic() - start\n"
          "cpu = sum(sum(os.wait4(pid, 0)[2][:2]) for pid in pids)\nprint(cpu <= wall + 0.15, round(cpu, 3), round(wall, 3))",
          "ok", check=lambda r: r.stdout.startswith("True ")),
    _case("non_daemon_thread_spinning", "import threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\nprint('main done')",
          "ok", max_wall=PROMPT_S),
    # -- memory -----------------------------------------------------------------------------
    _case("bytearray_bomb", "x = bytearray(10 ** 11)", "memory"),
    _case("list_growth_bomb", "x = []\nwhile True:\n    x.append(bytes(10 ** 7))", "memory"),
    _case("numpy_huge_alloc", "import numpy as np\nnp.ones((10 ** 5, 10 ** 5))", "memory"),
    # -- output -----------------------------------------------------------------------------
    _case("stdout_1gb", "import sys\nfor _ in range(10 ** 6):\n    sys.stdout.write('x' * 1000)", "output_limit",
          check=lambda r: r.stdout_truncated and len(r.stdout) == OUTPUT_LIMIT),
    _case("huge_single_line", "print('y' * 10 ** 8)", "output_limit", check=lambda r: r.stdout_truncated),
    _case("stderr_flood", "import sys\nwhile True:\n    sys.stderr.write('e' * 4096)", "output_limit",
          check=lambda r: r.stderr_truncated and not r.stdout_truncated),
    _case("invalid_utf8_output", "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end')", "ok",
          check=lambda r: r.stdout == "ok \ufffd\ufffd end"),
    _case("unicode_output", "print('π ≈ 3.14159, 你好')", "ok", check=lambda r: r.stdout == "π ≈ 3.14159, 你好\n"),
    _case("huge_int_print", "print(10 ** 5000)", "error", check=_stderr_has("Exceeds the limit (4300 digits)")),
    _case("closes_stdout_and_stderr", "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(0.2)", "ok",
          check=lambda r: r.wall_s >= 0.2),
    # -- files ------------------------------------------------------------------------------
    _case("huge_file", "with open('big', 'wb') as f:\n    f.write(b'0' * (10 ** 8))", "error",
          check=_stderr_has("File too large")),
    _case("fill_scratch_dir", "for i in range(1000):\n    with open(f'f{i}', 'wb') as f:\n        f.write(b'0' * 10 ** 6)",
          "error", check=_stderr_has("No space left")),
    _case("delete_outside_scratch", f"import os\nos.remove({VICTIM!r})", "error"),
    _case("write_to_project_dir", f"open({os.path.join(os.path.dirname(__file__), 'probe')!r}, 'w')", "error"),
    _case("answers_and_repo_invisible",
          f"import os\nprint([os.path.exists(p) for p in {[VICTIM, __file__, os.path.dirname(__file__)]!r}])",
          "ok", check=lambda r: r.stdout == "[False, False, False]\n"),
    # What the call may see is defined from its own interpreter: its prefixes and sys.path.
    _case("root_home_hidden", INSTALLATION + f"home = {os.path.expanduser('~')!r}\n"
          "listing = sorted(os.listdir(home)) if os.path.isdir(home) else []\n"
          "print([n for n in listing if not leads_to_installation(os.path.join(home, n))])",
          "ok", check=lambda r: r.stdout == "[]\n"),
    _case("only_installation_and_system_visible", INSTALLATION + """
extra = []
def walk(d):
    for name in sorted(os.listdir(d)):
        path = os.path.join(d, name)
        if path in SYSTEM or any(path == p or path.startswith(p + '/') for p in installed):
            continue
        if leads_to_installation(path) and os.path.isdir(path) and not os.path.islink(path):
            walk(path)
        else:
            extra.append(path)
walk('/')
print(extra)""", "ok", check=lambda r: r.stdout == "[]\n"),
    _case("mounts_read_only_nosuid", "print([l.split()[4] for l in open('/proc/self/mountinfo')\n"
          "       if 'nosuid' not in l.split()[5].split(',')\n"
          "       or ('rw' in l.split()[5].split(',') and l.split()[4] not in ('/tmp', '/dev/shm', '/proc'))])",
          "ok", check=lambda r: r.stdout == "[]\n"),
    _case("too_many_open_files", "fs = [open('/dev/null') for _ in range(10 ** 4)]", "error",
          check=_stderr_has("Too many open files")),
    # -- signals and exits ------------------------------------------------------------------
    _case("os_exit_3", "import os\nprint('lost: buffered')\nos._exit(3)", "error",
          check=lambda r: r.exit_code == 3 and r.stdout == ""),
    _case("sys_exit_3", "import sys\nprint('kept')\nsys.exit(3)", "error",
          check=lambda r: r.exit_code == 3 and r.stdout == "kept\n"),
    _case("sys_exit_0", "import sys\nsys.exit(0)", "ok"),
    _case("sys_exit_message", "import sys\nsys.exit('bad input')", "error", check=_stderr_has("bad input")),
    _case("segfault_ctypes", "import ctypes\nctypes.string_at(0)", "killed",
          check=lambda r: r.signal == signal.SIGSEGV),
    # Deep C recursion: the interpreter either overflows the C stack (SIGSEGV, Python <= 3.11)
    # or, with its own C recursion guard (3.12+), raises RecursionError; either way it fails alone.
    _case("c_stack_overflow", "import json, sys\nsys.setrecursionlimit(10 ** 7)\njson.loads('[' * 10 ** 6 + ']' * 10 ** 6)",
          ("killed", "error"), check=lambda r: r.signal == signal.SIGSEGV if r.status == "killed"
          else "RecursionError" in r.stderr),
    _case("kill_parent", "import os\nos.kill(os.getppid(), 9)\nprint('alive')", "ok"),
    _case("kill_all_of_my_uid", "import os, time\nif os.fork() == 0:\n    time.sleep(100)\n"
          "os.kill(-1, 9)\nprint('alive', os.wait()[1])", "ok", check=lambda r: r.stdout == "alive 9\n"),
    _case("keyboard_interrupt", "raise KeyboardInterrupt", "error", check=_stderr_has("KeyboardInterrupt")),
    _case("setuid_root", "import os\nos.setuid(0)", "error", check=_stderr_has("PermissionError")),
    _case("no_new_privs", "print(next(l for l in open('/proc/self/status') if l.startswith('NoNewPrivs')).split()[1])",
          "ok", check=lambda r: r.stdout == "1\n"),
    # fd 3 once carried the call's status to the template: writing "setup" made it a sandbox_error.
    _case("no_descriptor_but_stdio", "import os\nopen_fds = []\nfor fd in range(3, 1024):\n    try:\n"
          "        os.write(fd, b'setup')\n        open_fds.append(fd)\n    except OSError:\n        pass\n"
          "print(open_fds)", "ok", check=lambda r: r.stdout == "[]\n"),
    # -- stdin ------------------------------------------------------------------------------
    _case("input_with_stdin", "a = input()\nb = input()\nprint(int(a) + int(b))", "ok", stdin="2\n40\n",
          check=lambda r: r.stdout == "42\n"),
    _case("input_without_stdin", "input()", "error", check=_stderr_has("EOFError")),
    _case("large_stdin", "import sys\nprint(len(sys.stdin.read()))", "ok", stdin="z" * 10 ** 6,
          check=lambda r: r.stdout == "1000000\n"),
    # A model writes "\\ud800" in the JSON of its call: a lone surrogate no program can read.
    _case("lone_surrogate_stdin", "print(input())", "error", stdin="\ud800",
          check=lambda r: "stdin is not valid text" in r.stderr),
    _case("lone_surrogate_code", "print('\ud800')", "error", check=_stderr_has("surrogates not allowed")),
    _case("any_code_point_in_stdin", "import sys\nprint([hex(ord(c)) for c in sys.stdin.read()])", "ok",
          stdin="\x00\x7f\xff\ufffd\uffff\U0001f600\U0010ffff",
          check=lambda r: r.stdout == "['0x0', '0x7f', '0xff', '0xfffd', '0xffff', '0x1f600', '0x10ffff']\n"),
    _case("astral_stdin_8mib", "import sys\nprint(len(sys.stdin.read()))", "ok", stdin="\U0001f600" * (2 << 20),
          check=lambda r: r.stdout == f"{2 << 20}\n"),
    _case("nul_in_code", "print(1)\x00", "error", check=_stderr_has("null bytes")),
    # -- network ----------------------------------------------------------------------------
    _case("network_connect", "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=0.5)", "error",
          check=_stderr_has("OSError")),
    _case("loopback_listen", "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\nsocket.create_connection(s.getsockname(), timeout=0.5)",
          "error"),
    # -- kernel interfaces between calls, or past the call's namespaces ---------------------
    # A user namespace would make the call root with every capability in it (mounts, network
    # devices, netfilter); clone3 hides its flags from the filter, so it reports ENOSYS and the
    # C library falls back to clone (threads and subprocesses below still work).
    _case("user_namespace_refused",
          "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "clone, unshare = {'x86_64': (56, 272), 'aarch64': (220, 97)}[os.uname().machine]\n"
          "def err(ret):\n    return errno.errorcode[ctypes.get_errno()] if ret == -1 else 'allowed'\n"
          "print(err(libc.unshare(0x10000000)), err(libc.syscall(clone, 0x10000000 | 17, 0, 0, 0, 0)),\n"
          "      err(libc.syscall(unshare, 0x40000000)), err(libc.syscall(435, 0, 0)))",
          "ok", check=lambda r: r.stdout == "EPERM EPERM EPERM ENOSYS\n"),
    _case("threads_and_subprocesses_work",
          "import subprocess, threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
          "print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, end='')",
          "ok", check=lambda r: r.stdout == "thread\nchild\n"),
    # A lock on a file every call can open would block (or signal to) calls of other templates.
    _case("flock_refused", "import fcntl, sys\nfcntl.flock(open(sys.executable, 'rb'), fcntl.LOCK_EX | fcntl.LOCK_NB)",
          "error", check=_stderr_has("PermissionError")),
    # A watch on the installation would show which files other calls and the trainer open.
    _case("inotify_refused", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "print(libc.inotify_init1(0), os.strerror(ctypes.get_errno()))",
          "ok", check=lambda r: r.stdout == "-1 Operation not permitted\n"),
    # -- interpreter state ------------------------------------------------------------------
    _case("poison_builtins", "import builtins\nbuiltins.print = None\nbuiltins.len = None", "ok"),
    _case("clear_sys_modules_and_chdir", "import os, sys\nos.chdir('/')\nsys.modules.clear()", "ok"),
    _case("syntax_error", "def f(:\n    pass", "error", check=_stderr_has("SyntaxError")),
    _case("missing_module", "import no_such_module_xyz", "error", check=_stderr_has("ModuleNotFoundError")),
    _case("huge_code", "x = 0\n" + "x += 1\n" * 20_000 + "print(x)", "ok", check=lambda r: r.stdout == "20000\n"),
    _case("sleep_within_deadline", "import time\ntime.sleep(0.3)\nprint('done')", "ok",
          check=lambda r: r.stdout == "done\n"),
]


def _processes_of_uids(first: int, last: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/status") as f:
                    uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
            except (OSError, StopIteration):
                continue
            if first <= uid <= last:
                found.append(int(name))
    return found


class _Listeners:
    """Host unix sockets (a file in ``directory``, mode 0777, and an abstract name) that count
    every connection they accept."""

    def __init__(self, directory: str):
        self.path = os.path.join(directory, "host.sock")
        self.abstract = f"\0rstar2-sandbox-probe-{os.getpid()}"
        self.sockets = []
        for address in (self.path, self.abstract):
            s = socket.socket(socket.AF_UNIX)
            s.bind(address)
            s.listen()
            self.sockets.append(s)
        os.chmod(self.path, 0o777)
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            for s in select.select(self.sockets, [], [], 0.1)[0]:
                s.accept()[0].close()
                self.accepted += 1

    def close(self):
        self._stop.set()
        self._thread.join()
        for s in self.sockets:
            s.close()


def _probe_cases(probe_dir: str, listeners: _Listeners, template_pid: int) -> dict[str, tuple]:
    """Cases that need what the fixture set up: (code, status, check) by id."""
    suid = os.path.join(probe_dir, "suid-sleep")
    connect = "import socket\ns = socket.socket(socket.AF_UNIX)\ns.settimeout(0.5)\ns.connect({!r})\nprint('connected')"
    return {
        "kill_worker": (f"import os\nos.kill({template_pid}, 9)", "error",
                        # The template's pid does not exist in the call's PID namespace.
                        lambda r: "ProcessLookupError" in r.stderr),
        "unix_socket_file_unreachable": (connect.format(listeners.path), "error", lambda r: r.stdout == ""),
        "abstract_unix_socket_unreachable": (connect.format(listeners.abstract), "error", lambda r: r.stdout == ""),
        # A call's network namespace is its slot's, not the template's (see
        # test_concurrent_calls_never_share_a_network_namespace).
        "own_network_namespace": ("import os\nprint(os.readlink('/proc/self/ns/net'))", "ok",
                                  lambda r: r.stdout.startswith("net:[")
                                  and r.stdout != os.readlink(f"/proc/{template_pid}/ns/net") + "\n"),
        # The binary is visible (its directory is on PYTHONPATH) but must not run as root.
        "setuid_binary_gains_nothing": (
            f"import os, subprocess, time\np = subprocess.Popen([{suid!r}, '10'])\ntime.sleep(0.3)\n"
            "uids = next(l for l in open(f'/proc/{p.pid}/status') if l.startswith('Uid:')).split()[1:]\n"
            "p.kill()\nprint(sorted(set(uids)) == [str(os.getuid())], uids)",
            "ok", lambda r: r.stdout.startswith("True")),
    }


# Looks for canaries in the call's own writable memory; prints what it found.
SCAN_MEMORY = """import ctypes, hashlib
wanted = {wanted!r}
mark = {mark!r}.encode()
found = set()
for line in open('/proc/self/maps').read().splitlines():
    fields = line.split()
    if not fields[1].startswith('rw') or (len(fields) > 5 and fields[5].startswith('[v')):
        continue
    lo, hi = (int(x, 16) for x in fields[0].split('-'))
    data = ctypes.string_at(lo, hi - lo)
    i = data.find(mark)
    while i >= 0:
        found.add(wanted.get(hashlib.sha256(data[i:i + len(mark) + 32]).hexdigest()))
        i = data.find(mark, i + 1)
print(sorted(f for f in found if f))
"""


def _may_time_out(status) -> bool:
    return "timeout" in ((status,) if isinstance(status, str) else status)


# Session mode: the first cell of every case's session, and the third (after the case).
STATE_CELL = "import math\nstate = math.factorial(5)"
FOLLOW_UP_CELL = "print(state)"


def _run_calls(calls: dict, pools: dict, sessions: dict | None) -> dict:
    """Results by case id of ``calls`` (id -> (code, stdin, pool key)), all in flight at once;
    in session mode (``sessions``: an empty dict to fill with each case's session) each call is
    the second cell of its session, after ``STATE_CELL``."""
    if sessions is None:
        futures = {name: pools[key].submit(code, stdin) for name, (code, stdin, key) in calls.items()}
        return {name: f.result() for name, f in futures.items()}
    sessions.update({name: pools[key].session() for name, (_, _, key) in calls.items()})
    first = [s.submit(STATE_CELL) for s in sessions.values()]
    assert all(f.result().status == "ok" for f in first)
    futures = {name: sessions[name].submit(code, stdin) for name, (code, stdin, _) in calls.items()}
    return {name: f.result() for name, f in futures.items()}


def _run_batch(suite, pool: SandboxPool, codes: list[str]) -> list:
    """``codes`` at once on ``pool``: stateless calls, or in session mode each the second cell of
    a session of its own."""
    sessions = {} if suite[8] == "session" else None
    results = _run_calls({i: (code, "", "pool") for i, code in enumerate(codes)}, {"pool": pool}, sessions)
    for session in (sessions or {}).values():
        session.close()
    return [results[i] for i in range(len(codes))]


@pytest.fixture(scope="module", params=["stateless", "session"])
def suite(request):
    """Run every case at once, as stateless calls or as cells of sessions; yield (results by
    case id, pool, its health, listeners, probe cases, the scratch directory's listing before,
    the patient pool, its health, the mode, the sessions by case id); check cleanup after
    close."""
    mode = request.param
    with open(VICTIM, "w") as f:
        f.write("keep me")
    probe_dir = tempfile.mkdtemp(dir="/var/tmp", prefix="rstar2-sandbox-probe-")
    os.chmod(probe_dir, 0o755)
    suid = os.path.join(probe_dir, "suid-sleep")
    shutil.copy(shutil.which("sleep"), suid)
    os.chown(suid, 0, 0)
    os.chmod(suid, 0o4755)
    listeners = _Listeners(probe_dir)
    saved = {k: os.environ.get(k) for k in ("HF_TOKEN", "PYTHONPATH")}
    os.environ.update(HF_TOKEN=ENV_SECRET, PYTHONPATH=probe_dir)
    try:
        pool, patient = (SandboxPool(num_workers=2, timeout_s=timeout, slots_per_worker=32,
                                     output_limit_bytes=OUTPUT_LIMIT, memory_bytes=MEMORY_LIMIT)
                         for timeout in (TIMEOUT_S, PATIENT_TIMEOUT_S))
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.update({k: v})
    health = pool.health()
    assert health["isolation"] == "namespaces", "this machine grants namespaces; see docs/sandbox.md"
    assert health["memory_limit"].startswith("cgroup"), "this machine grants memory cgroups; see docs/sandbox.md"
    assert health["cpu_limit"].startswith("cgroup"), "this machine grants CPU cgroups; see docs/sandbox.md"
    scratch_before = pool.run("import os\nprint(os.getcwd(), os.listdir('.'))").stdout
    patient_health = patient.health()
    probes = _probe_cases(probe_dir, listeners, patient_health["template_pids"][0])
    calls = {p.id: (p.values[0], p.values[1], _may_time_out(p.values[2])) for p in CASES}
    calls.update({name: (code, "", False) for name, (code, _, _) in probes.items()})
    sessions = {} if mode == "session" else None
    by_id = _run_calls(calls, {True: pool, False: patient}, sessions)
    yield by_id, pool, health, listeners, probes, scratch_before, patient, patient_health, mode, sessions
    for session in (sessions or {}).values():
        session.close()
    assert pool.health()["sessions"] == patient.health()["sessions"] == 0
    pool.close()
    patient.close()
    listeners.close()
    shutil.rmtree(probe_dir)
    assert os.path.exists(VICTIM)
    os.remove(VICTIM)
    leftovers = _processes_of_uids(*health["slot_uids"])
    assert leftovers == [], f"processes of the pool's slot uids still running: {leftovers}"
    for pid in health["template_pids"]:
        assert not os.path.exists(f"/proc/{pid}"), f"template {pid} still running after close()"


@pytest.mark.parametrize("code, stdin, status, check, max_wall", CASES)
def test_case(suite, request, code, stdin, status, check, max_wall):
    result = suite[0][request.node.callspec.id.replace(f"{suite[8]}-", "", 1)]
    assert result.status in ((status,) if isinstance(status, str) else status), result
    if check is not None:
        assert check(result), result
    if result.status == "timeout":
        assert TIMEOUT_S <= result.wall_s < TIMEOUT_S + 1.0, result
    if max_wall is not None:
        assert result.wall_s < max_wall, result


@pytest.mark.parametrize("name", ["kill_worker", "unix_socket_file_unreachable", "abstract_unix_socket_unreachable",
                                  "own_network_namespace", "setuid_binary_gains_nothing"])
def test_probe_case(suite, name):
    _, status, check = suite[4][name]
    result = suite[0][name]
    assert result.status == status and check(result), result


def test_host_listeners_got_no_connection(suite):
    assert suite[3].accepted == 0


def test_session_follow_ups_fail_alone(suite):
    """Session mode: a third cell in every case's session replays the hostile cell (when it ran
    to its end or an exception). Whatever it does to its own session, every follow-up resolves
    without a sandbox error, and a session that did nothing hostile still has its state."""
    _, pool, _, _, _, _, _, _, mode, sessions = suite
    if mode != "session":
        return
    futures = {name: s.submit(FOLLOW_UP_CELL) for name, s in sessions.items()}
    follow_ups = {name: f.result() for name, f in futures.items()}
    assert not [name for name, r in follow_ups.items() if r.status == "sandbox_error"], follow_ups
    for name in ("unicode_output", "sys_exit_3", "input_with_stdin", "sleep_within_deadline", "huge_code"):
        assert follow_ups[name].stdout == "120\n", (name, follow_ups[name])
    with pool.session() as control:
        control.run(STATE_CELL)
        assert control.run(FOLLOW_UP_CELL).stdout == "120\n"


def test_pools_healthy_after_suite(suite):
    _, pool, health, _, _, scratch_before, patient, patient_health, _, _ = suite
    for p, before in ((pool, health), (patient, patient_health)):
        after = p.health()
        assert after["healthy"] and after["template_pids"] == before["template_pids"]
        assert p.stats()["respawns"] == 0 and p.stats()["sandbox_error"] == 0
    # Calls after the suite see a clean interpreter (builtins, sys.modules, cwd were poisoned)
    # and a scratch directory as empty as before it.
    results = patient.run_batch(["print(len('abc'))", "import os\nprint(os.getcwd(), os.listdir('.'))", "6 * 7"] * 10)
    assert [r.stdout for r in results[:3]] == ["3\n", scratch_before, "42\n"]
    assert scratch_before.startswith("/tmp ")
    assert all(r.status == "ok" for r in results)


def test_call_memory_holds_no_secret_and_no_other_call(suite):
    """No trainer secret (the environment the pool was started in) and nothing of another call
    (code, stdin, output of calls in flight on the same templates) is in a call's memory."""
    pool, mode = suite[6], suite[8]
    wanted = {hashlib.sha256(s.encode()).hexdigest(): label
              for s, label in ((ENV_SECRET, "environment"), (CALL_SECRET, "other call"))}
    other = f"import time\nprint({CALL_SECRET!r}, input(), flush=True)\ntime.sleep(3)"
    scan = SCAN_MEMORY.format(wanted=wanted, mark=MARK)
    sessions = []
    if mode == "session":
        # The other calls are sessions whose earlier cell (replayed) holds the secret too; each
        # scan runs in a session of its own, after a cell of its own.
        sessions = [pool.session() for _ in range(4)]
        for s in sessions[:2]:
            s.run(f"secret = {CALL_SECRET!r} + input()", CALL_SECRET + "\n")
        for s in sessions[2:]:
            s.run("import ctypes")
        submit_other = [s.submit for s in sessions[:2]]
        submit_scan = [s.submit for s in sessions[2:]]
    else:
        submit_other = submit_scan = [pool.submit] * 2
    # Two of each: the pool sends each call to the template with fewest calls in flight, so
    # each template holds one of the other calls when it starts a scan.
    others = [submit(other, CALL_SECRET + "\n") for submit in submit_other]
    time.sleep(0.3)
    scans = [f.result() for f in [submit(scan) for submit in submit_scan]]
    assert [f.result().status for f in others] == ["ok", "ok"]
    for s in sessions:
        s.close()
    for scan in scans:
        assert scan.status == "ok" and scan.stdout == "[]\n", scan


def test_memory_limit_covers_all_of_a_call(suite):
    """800 MB over four processes, or 600 MB of memfd files (memory no process maps): each
    process stays under its address-space limit, the call as a whole must not. In the patient
    pool: filling 800 MB takes ~0.35 s of CPU (measured in each process: the same per page as
    under the limit, no swap, no reclaim), but on a loaded 2-core machine those processes wait
    several times longer than that for a CPU, which once took the call past a 1.5 s deadline."""
    forks = ("import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n"
             "    if pid == 0:\n        x = b'x' * (200 << 20)\n        time.sleep(0.3)\n        os._exit(0)\n"
             "    pids.append(pid)\nprint([os.waitpid(p, 0)[1] for p in pids])")
    memfds = ("import os\nblock = b'x' * (15 << 20)\nfds = []\nfor _ in range(40):\n"
              "    fds.append(os.memfd_create('m'))\n    os.write(fds[-1], block)\nprint(len(fds))")
    for result in _run_batch(suite, suite[6], [forks, memfds]):
        assert result.status == "memory" and str(MEMORY_LIMIT) in result.detail, result


def test_concurrent_calls_never_share_a_network_namespace(suite):
    """Calls of one template shared its network namespace: netlink messages passed between
    concurrent calls and port binds collided. Six calls on two templates, each holding an
    INADDR_ANY port that all of them ask for: any two that ran at the same time had different
    namespaces, and every bind succeeded."""
    code = ("import os, socket, time\nstart = time.monotonic()\ns = socket.socket()\ns.bind(('0.0.0.0', 4242))\n"
            "time.sleep(2)\nprint(os.readlink('/proc/self/ns/net'), start, time.monotonic())")
    results = _run_batch(suite, suite[6], [code] * 6)
    assert all(r.status == "ok" for r in results), results
    spans = [(ns, float(start), float(end)) for ns, start, end in (r.stdout.split() for r in results)]
    overlapping = [(a, b) for i, a in enumerate(spans) for b in spans[i + 1:] if a[1] < b[2] and b[1] < a[2]]
    assert overlapping, spans
    assert all(a[0] != b[0] for a, b in overlapping), spans


def _cpu_cgroup_dir(cgroup_file_text: str) -> str:
    """The host directory of the CPU cgroup named in a process's /proc/<pid>/cgroup."""
    paths = {}
    for line in cgroup_file_text.splitlines():
        _, controllers, path = line.split(":", 2)
        for controller in controllers.split(",") if controllers else ["(v2)"]:
            paths[controller] = path
    with open("/proc/self/mountinfo") as f:
        for fields in (line.split() for line in f):
            fstype, options = fields[fields.index("-") + 1], fields[fields.index("-") + 3].split(",")
            if (fstype == "cgroup" and "cpu" in options) or (fstype == "cgroup2" and "cpu" not in paths):
                path = paths["cpu" if fstype == "cgroup" else "(v2)"]
                return os.path.join(fields[4], os.path.relpath(path, fields[3]))
    raise AssertionError("no CPU cgroup hierarchy")


def test_a_call_and_its_sessions_share_one_cpu_cgroup(suite):
    """Under kernel autogroup scheduling each session is weighed alone: without a CPU bound per
    call, 16 children that each called setsid() took 16 shares of the CPU from the trainer and
    from other calls (a neighbour's 0.75 s call timed out at 4 s). Every process of a call, in
    any session, is in its slot's CPU cgroup, whose quota is one CPU."""
    (result,) = _run_batch(suite, suite[6], ["import os\nmine = open('/proc/self/cgroup').read()\nr, w = os.pipe()\n"
                         "if os.fork() == 0:\n    os.setsid()\n    os.write(w, open('/proc/self/cgroup').read().encode())\n"
                         "    os._exit(0)\nos.wait()\nprint(repr(mine))\nprint(repr(os.read(r, 1 << 16).decode()))"])
    assert result.status == "ok", result
    parent, child = (ast.literal_eval(line) for line in result.stdout.splitlines())
    group = _cpu_cgroup_dir(parent)
    assert _cpu_cgroup_dir(child) == group and os.path.basename(group).startswith("rstar2-sandbox-"), result
    if os.path.exists(os.path.join(group, "cpu.max")):
        quota, period = open(os.path.join(group, "cpu.max")).read().split()
    else:
        quota, period = (open(os.path.join(group, name)).read().strip() for name in ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
    assert quota == period


def test_ipc_and_keys_do_not_outlive_their_call(suite):
    """SysV shared memory, POSIX message queues and keyring entries made by one call are gone
    for the next one (the calls run one after the other, on the same template and slot; in
    session mode, in two sessions)."""
    add_key, keyctl = KEY_SYSCALLS
    common = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.mq_open.restype = ctypes.c_int\n"
    (first,) = _run_batch(suite, suite[6], [common + f"""
shm = libc.shmget(0x5EED, 1 << 20, 0o1666)
libc.shmat.restype = ctypes.c_void_p
ctypes.memset(libc.shmat(shm, None, 0), 7, 1 << 20)
mq = libc.mq_open(b'/rstar2-probe', os.O_CREAT | os.O_RDWR, 0o666, None)
key = libc.syscall({add_key}, b'user', b'rstar2-probe', b'secret', 6, -4)
print(shm >= 0, mq >= 0, key >= 0 or os.strerror(ctypes.get_errno()))"""])
    assert first.status == "ok", first
    # The call's own IPC objects work; the keyring is refused outright.
    assert first.stdout == "True True Operation not permitted\n", first
    (second,) = _run_batch(suite, suite[6], [common + """
print(libc.shmget(0x5EED, 0, 0), libc.mq_open(b'/rstar2-probe', os.O_RDONLY), 'rstar2-probe' in open('/proc/keys').read(),
      len(open('/proc/sysvipc/shm').readlines()))"""])
    assert second.status == "ok" and second.stdout == "-1 -1 False 1\n", second


def test_many_concurrent_timeouts_then_trivial_calls(suite):
    """100 calls that sleep past their deadline on 64 slots run side by side, not one after
    another: each prints when it started, and many were running at the same moment. Then
    every slot is free again."""
    pool = suite[1]
    results = _run_batch(suite, pool, ["import time\nprint(time.monotonic(), flush=True)\ntime.sleep(100)"] * 100)
    assert [r.status for r in results] == ["timeout"] * 100
    starts = sorted(float(r.stdout) for r in results)
    at_once = max(sum(s <= t < s + TIMEOUT_S for t in starts) for s in starts)
    assert at_once >= 16, f"at most {at_once} of 100 sleeping calls ran at the same time"
    trivial = _run_batch(suite, pool, [f"print({i})" for i in range(20)])
    assert [r.stdout for r in trivial] == [f"{i}\n" for i in range(20)]
    assert pool.health()["in_flight"] == 0
