"""Adversarial suite: hostile or broken tool code against one pool, all cases run concurrently.

Each case states the status it must get; afterwards the pool must be healthy, fast, unchanged
(no template died) and, once closed, must leave no process behind.
"""
import os
import signal
import time

import pytest

from rstar2_jax.sandbox import SandboxPool

TIMEOUT_S = 1.5
OUTPUT_LIMIT = 64 << 10
VICTIM = f"/var/tmp/rstar2_sandbox_victim_{os.getpid()}"


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
    _case("deep_python_recursion", "import sys\nsys.setrecursionlimit(10**8)\nf = lambda n: f(n + 1)\nf(0)",
          "timeout"),
    _case("blocked_reading_own_pipe", "import os\nr, w = os.pipe()\nos.read(r, 1)", "timeout"),
    # -- processes and threads --------------------------------------------------------------
    # Whether the main process is the first to hit RLIMIT_NPROC (error) or keeps forking until
    # the deadline (timeout) depends on scheduling; either way the tree is contained and killed.
    _case("fork_bomb", "import os\nwhile True:\n    os.fork()", ("error", "timeout"),
          check=_stderr_has("BlockingIOError")),
    _case("thread_bomb", "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(100,)).start()",
          "error", check=_stderr_has("can't start new thread")),
    _case("setsid_grandchild_holds_stdout",
          "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\nprint('parent done')",
          "ok", check=lambda r: r.stdout == "parent done\n", max_wall=0.9),
    _case("double_fork_daemon",
          "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True: pass\n    os._exit(0)\nprint('ok')",
          "ok", max_wall=0.9),
    _case("subprocess_left_running", "import subprocess\nsubprocess.Popen(['sleep', '100'])\nprint('spawned')", "ok",
          max_wall=0.9),
    _case("multiprocessing_pool", "from multiprocessing import Pool\nwith Pool(4) as p:\n    print(sum(p.map(abs, range(-10, 0))))",
          "ok", check=lambda r: r.stdout == "55\n"),
    _case("non_daemon_thread_spinning", "import threading\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\nprint('main done')",
          "ok", max_wall=0.9),
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
    _case("write_to_project_dir", "open('/work/rstar2_sandbox_probe', 'w')", "error"),
    _case("root_home_hidden", "import os\nprint(sorted(os.listdir('/root')))", "ok",
          check=lambda r: r.stdout == "['.pyenv']\n"),
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
    _case("c_stack_overflow", "import json, sys\nsys.setrecursionlimit(10 ** 7)\njson.loads('[' * 10 ** 6 + ']' * 10 ** 6)",
          "killed", check=lambda r: r.signal == signal.SIGSEGV),
    _case("kill_parent", "import os\nos.kill(os.getppid(), 9)\nprint('alive')", "ok"),
    _case("kill_all_of_my_uid", "import os, time\nif os.fork() == 0:\n    time.sleep(100)\n"
          "os.kill(-1, 9)\nprint('alive', os.wait()[1])", "ok", check=lambda r: r.stdout == "alive 9\n"),
    _case("keyboard_interrupt", "raise KeyboardInterrupt", "error", check=_stderr_has("KeyboardInterrupt")),
    _case("setuid_root", "import os\nos.setuid(0)", "error", check=_stderr_has("PermissionError")),
    # -- stdin ------------------------------------------------------------------------------
    _case("input_with_stdin", "a = input()\nb = input()\nprint(int(a) + int(b))", "ok", stdin="2\n40\n",
          check=lambda r: r.stdout == "42\n"),
    _case("input_without_stdin", "input()", "error", check=_stderr_has("EOFError")),
    _case("large_stdin", "import sys\nprint(len(sys.stdin.read()))", "ok", stdin="z" * 10 ** 6,
          check=lambda r: r.stdout == "1000000\n"),
    # -- network ----------------------------------------------------------------------------
    _case("network_connect", "import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=0.5)", "error",
          check=_stderr_has("OSError")),
    _case("loopback_listen", "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\nsocket.create_connection(s.getsockname(), timeout=0.5)",
          "error"),
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


@pytest.fixture(scope="module")
def suite():
    """Run every case at once; yield (results by case id, pool info); check cleanup after close."""
    with open(VICTIM, "w") as f:
        f.write("keep me")
    pool = SandboxPool(num_workers=2, timeout_s=TIMEOUT_S, slots_per_worker=32, output_limit_bytes=OUTPUT_LIMIT)
    health = pool.health()
    assert health["isolation"] == "namespaces", "this machine grants namespaces; see docs/sandbox.md"
    # The template pid is only known now, so this case is built here.
    kill_worker = f"import os\nos.kill({health['template_pids'][0]}, 9)"
    codes = [(p.values[0], p.values[1]) for p in CASES] + [(kill_worker, "")]
    start = time.monotonic()
    results = pool.run_batch(codes)
    suite_wall = time.monotonic() - start
    by_id = {p.id: r for p, r in zip(CASES, results)}
    by_id["kill_worker"] = results[-1]
    yield by_id, pool, health, suite_wall
    pool.close()
    assert os.path.exists(VICTIM)
    os.remove(VICTIM)
    leftovers = _processes_of_uids(*health["slot_uids"])
    assert leftovers == [], f"processes of the pool's slot uids still running: {leftovers}"
    for pid in health["template_pids"]:
        assert not os.path.exists(f"/proc/{pid}"), f"template {pid} still running after close()"


@pytest.mark.parametrize("code, stdin, status, check, max_wall", CASES)
def test_case(suite, request, code, stdin, status, check, max_wall):
    result = suite[0][request.node.callspec.id]
    assert result.status in ((status,) if isinstance(status, str) else status), result
    if check is not None:
        assert check(result), result
    if result.status == "timeout":
        assert TIMEOUT_S <= result.wall_s < TIMEOUT_S + 1.0, result
    if max_wall is not None:
        assert result.wall_s < max_wall, result


def test_kill_worker_is_refused(suite):
    result = suite[0]["kill_worker"]
    # The template's pid does not exist in the call's PID namespace.
    assert result.status == "error" and "ProcessLookupError" in result.stderr, result


def test_pool_healthy_and_fast_after_suite(suite):
    _, pool, health, suite_wall = suite
    assert suite_wall < 15, f"suite took {suite_wall:.1f} s"
    after = pool.health()
    assert after["healthy"] and after["template_pids"] == health["template_pids"]
    assert pool.stats()["respawns"] == 0 and pool.stats()["sandbox_error"] == 0
    # Calls after the suite see a clean interpreter (builtins, sys.modules, cwd were poisoned).
    start = time.monotonic()
    results = pool.run_batch(["print(len('abc'))", "import os\nprint(os.getcwd(), os.listdir('.'))", "6 * 7"] * 10)
    assert time.monotonic() - start < 5
    assert [r.stdout for r in results[:3]] == ["3\n", "/tmp []\n", "42\n"]
    assert all(r.status == "ok" for r in results)


def test_many_concurrent_timeouts_then_trivial_calls(suite):
    _, pool, _, _ = suite
    start = time.monotonic()
    results = pool.run_batch(["import time\ntime.sleep(100)"] * 100)
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["timeout"] * 100
    # 64 slots: two rounds of deadlines, not 100 sequential timeouts.
    assert elapsed < 4 * TIMEOUT_S + 2, f"100 timeouts took {elapsed:.1f} s"
    start = time.monotonic()
    trivial = pool.run_batch([f"print({i})" for i in range(20)])
    assert [r.stdout for r in trivial] == [f"{i}\n" for i in range(20)]
    assert time.monotonic() - start < 3
