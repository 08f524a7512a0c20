"""The adversarial sandbox suite's catalogue (run by `test_sandbox_adversarial.py`): the limits
and planted secrets its pools start with, and the cases, each a piece of hostile or broken tool
code with the status it must get and what its output must show."""
import os
import secrets
import signal

import pytest

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


# Tries every interface that evicts or probes the page cache of a file of the installation;
# prints whether all were refused and what each returned.
PAGE_CACHE_PROBES = """import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
fd = os.open(sys.executable, os.O_RDONLY)
page = ctypes.c_void_p(libc.mmap(None, 4096, 1, 1, fd, 0))  # PROT_READ, MAP_SHARED
nr = {'x86_64': dict(readahead=187, io_setup=206), 'aarch64': dict(readahead=213, io_setup=0)}[os.uname().machine]
def c(ret):
    return 'allowed' if ret != -1 else ctypes.get_errno()
def py(f):
    try:
        f()
        return 'allowed'
    except OSError as e:
        return e.errno
out = dict(
    fadvise=py(lambda: os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)),
    preadv2_nowait=py(lambda: os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)),
    pwritev2_nowait=py(lambda: os.pwritev(os.open('probe', os.O_CREAT | os.O_WRONLY), [b'x'], 0, os.RWF_NOWAIT)),
    mincore=c(libc.mincore(page, 4096, ctypes.create_string_buffer(1))),
    cachestat=c(libc.syscall(451, fd, ctypes.create_string_buffer(16), ctypes.create_string_buffer(48), 0)),
    madvise_pageout=c(libc.madvise(page, 4096, 21)),
    madvise_cold=c(libc.madvise(page, 4096, 20)),
    process_madvise=c(libc.syscall(440, os.pidfd_open(os.getpid()), None, 0, 21, 0)),
    readahead=c(libc.syscall(nr['readahead'], fd, 0, 4096)),
    aio=c(libc.syscall(nr['io_setup'], 1, ctypes.byref(ctypes.c_ulong(0)))))
print(all(v != 'allowed' for v in out.values()), out)
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
    # Hard links on a tmpfs without an inode cap: ~1.8 million of them delayed the call's
    # teardown (outside its deadline) by ~30% of that deadline. The scratch tmpfs caps its
    # entries, hard links included.
    _case("hard_links_capped", "import os\nopen('f', 'w').close()\nn = 0\ntry:\n    while n < 10 ** 6:\n"
          "        os.link('f', f'l{n}')\n        n += 1\nexcept OSError as e:\n    print(n, e.strerror)",
          "ok", check=lambda r: r.stdout.endswith(" No space left on device\n") and int(r.stdout.split()[0]) < 10 ** 4),
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
    # Under the host's memory pressure the kernel kills a call before the trainer, and the call
    # cannot change that.
    _case("oom_score_adj_highest_and_fixed", "adj = open('/proc/self/oom_score_adj').read()\ntry:\n"
          "    open('/proc/self/oom_score_adj', 'w').write('0')\n    print(adj, 'lowered')\nexcept OSError as e:\n"
          "    print(adj.strip(), e.errno)", "ok", check=lambda r: r.stdout == "1000 13\n"),
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
    # fanotify and dnotify watch which files of the installation other calls and the trainer
    # open (fanotify with FAN_REPORT_FID needs no privilege since Linux 5.13).
    _case("fanotify_and_dnotify_refused", "import ctypes, fcntl, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "fan = libc.fanotify_init(0x200, 0)\ntry:\n    fcntl.fcntl(os.open('/usr', os.O_RDONLY), fcntl.F_NOTIFY, fcntl.DN_ACCESS)\n"
          "    dn = 'allowed'\nexcept OSError as e:\n    dn = e.errno\nprint(fan, dn)",
          "ok", check=lambda r: r.stdout == "-1 1\n"),
    # POSIX record locks (and OFD locks) on a file every call can open signal between calls as
    # flock did; F_GETLK reads another call's lock.
    _case("record_locks_refused", "import fcntl, os, struct, sys\nlock = struct.pack('hhqqi', fcntl.F_RDLCK, 0, 0, 0, 0)\n"
          "out = []\nfor path, cmd in ((sys.executable, fcntl.F_SETLK), (sys.executable, fcntl.F_GETLK), ('/dev/null', fcntl.F_SETLKW),\n"
          "                  ('/dev/null', 37), ('/dev/null', 36), ('/dev/null', 38)):\n"
          "    try:\n        fcntl.fcntl(os.open(path, os.O_RDONLY), cmd, lock)\n        out.append('allowed')\n"
          "    except OSError as e:\n        out.append(e.errno)\nprint(out)",
          "ok", check=lambda r: r.stdout == "[1, 1, 1, 1, 1, 1]\n"),
    # A NETLINK_KOBJECT_UEVENT socket receives the host's device events in every network
    # namespace; netlink is for the namespace's own routes (NETLINK_ROUTE), which still work.
    _case("uevent_socket_refused", "import socket\ntry:\n    socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, 15)\n"
          "    print('allowed')\nexcept OSError as e:\n    print(e.errno, [name for _, name in socket.if_nameindex()])",
          "ok", check=lambda r: r.stdout == "1 ['lo']\n"),
    # Page-cache state of the installation's files is shared by every call: evicting pages
    # (fadvise, madvise PAGEOUT/COLD, process_madvise) writes bits, probing them (mincore,
    # cachestat, RWF_NOWAIT reads and writes, Linux AIO, readahead) reads them exactly.
    _case("page_cache_interfaces_refused", PAGE_CACHE_PROBES, "ok",
          check=lambda r: r.stdout.startswith("True ")),
    # sync() while the host writes back (a checkpoint) held a killed call past its deadline;
    # the whole family returns at once, without reaching the kernel (an invalid descriptor
    # would fail with EBADF there).
    _case("sync_family_never_reaches_the_kernel", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
          "os.sync()\nos.fsync(1000)\nos.fdatasync(1000)\n"
          "print(libc.syncfs(1000), libc.sync_file_range(1000, 0, 0, 2))",
          "ok", check=lambda r: r.stdout == "0 0\n"),
    # -- interpreter state ------------------------------------------------------------------
    _case("poison_builtins", "import builtins\nbuiltins.print = None\nbuiltins.len = None", "ok"),
    _case("clear_sys_modules_and_chdir", "import os, sys\nos.chdir('/')\nsys.modules.clear()", "ok"),
    _case("syntax_error", "def f(:\n    pass", "error", check=_stderr_has("SyntaxError")),
    _case("missing_module", "import no_such_module_xyz", "error", check=_stderr_has("ModuleNotFoundError")),
    _case("huge_code", "x = 0\n" + "x += 1\n" * 20_000 + "print(x)", "ok", check=lambda r: r.stdout == "20000\n"),
    _case("sleep_within_deadline", "import time\ntime.sleep(0.3)\nprint('done')", "ok",
          check=lambda r: r.stdout == "done\n"),
]
