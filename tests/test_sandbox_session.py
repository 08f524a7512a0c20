"""Tool sessions: a trajectory's calls share state by replaying its earlier cells
(`rstar2_jax.sandbox.session`). The hostile cases run in session mode in
test_sandbox_adversarial.py."""
import secrets

import pytest

from rstar2_jax.sandbox import SandboxPool
from rstar2_jax.sandbox.session import replays
from rstar2_jax.sandbox.result import ExecResult


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(num_workers=2, timeout_s=2.0, output_limit_bytes=1 << 16) as p:
        yield p


def test_a_session_sees_its_own_earlier_cells_and_nothing_of_another(pool):
    tokens = [secrets.token_hex(8) for _ in range(2)]
    sessions = [pool.session() for _ in range(2)]
    # Interleaved, as the trajectories of a rollout are.
    for session, token in zip(sessions, tokens):
        assert session.run(f"import math\nsecret = {token!r}\nmine = 1").status == "ok"
    assert sessions[1].run("other = 2").status == "ok"
    for session, token in zip(sessions, tokens):
        result = session.run("print(secret, math.sqrt(16), 'other' in globals())")
        assert result.status == "ok" and result.stdout == f"{token} 4.0 {session is sessions[1]}\n", result
    fresh = pool.session()
    stateless = pool.run("print('secret' in globals(), 'mine' in globals())")
    assert stateless.stdout == "False False\n"
    assert fresh.run("secret").status == "error"
    for session in sessions + [fresh]:
        session.close()


def test_a_failing_cell_keeps_what_ran_before_it_and_does_not_break_the_replay(pool):
    with pool.session() as session:
        failed = session.run("a = 1\nraise ValueError('boom')\nb = 2")
        assert failed.status == "error" and "ValueError: boom" in failed.stderr
        exited = session.run("import sys\nc = 3\nsys.exit(4)\nd = 4")
        assert exited.status == "error" and exited.exit_code == 4
        assert session.run("def f(:\n    pass").status == "error"  # a syntax error replays as one
        assert session.run("import time\ne = 5\ntime.sleep(100)").status == "timeout"
        assert session.run("g = 7\nprint('g' * 10 ** 6)").status == "output_limit"
        assert session.run("print(input())", "\ud800").status == "error"  # never started
        result = session.run("print(a, c, [n in globals() for n in 'bdeg'])")
        assert result.status == "ok" and result.stdout == "1 3 [False, False, False, False]\n", result
        # Replayed: the cells that ran to their end or to an exception, and the last one.
        assert [code.split("\n")[0] for code, _ in session.cells] == ["a = 1", "import sys", "def f(:",
                                                                      "print(a, c, [n in globals() for n in 'bdeg'])"]


def test_replayed_output_is_silent_and_the_new_cell_speaks(pool):
    noisy = ("import os, subprocess, sys\nprint('noise')\nsys.stderr.write('err')\nos.write(1, b'raw')\n"
             "subprocess.run(['echo', 'child'])\nx = 6\nx * 100")
    with pool.session() as session:
        first = session.run(noisy)
        assert first.status == "ok" and "noise" in first.stdout and first.stderr == "err", first
        result = session.run("x * 7")
        assert result.status == "ok" and result.stdout == "42\n" and result.stderr == "", result


@pytest.mark.parametrize("noisy", [
    # writes to every descriptor it finds, among them those that held stdout and stderr
    "import os\nfor fd in range(3, 128):\n    try:\n        os.write(fd, b'leak')\n    except OSError:\n        pass",
    # an interval timer whose handler prints
    "import signal\nsignal.signal(signal.SIGALRM, lambda *_: print('tick', flush=True))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)",
    # a thread that prints (through sys.stdout and to descriptor 2), and starts another that does
    "import os, threading, time\ndef talk():\n    while True:\n        print('thread', flush=True)\n"
    "        os.write(2, b'raw')\n        time.sleep(0.01)\ndef start():\n    time.sleep(0.05)\n    talk()\n"
    "threading.Thread(target=talk, daemon=True).start()\nthreading.Thread(target=lambda: threading.Thread(target=start).start()).start()",
    # garbage with a finalizer that prints
    "class Loud:\n    def __del__(self):\n        print('finalized', flush=True)\nx = Loud()\nx.me = x\ndel x",
], ids=["saved_descriptors", "interval_timer", "threads", "finalizer"])
def test_what_replayed_cells_leave_running_stays_silent(pool, noisy):
    """The replay was silent only while it ran: the descriptors that saved stdout and stderr,
    interval timers, threads and finalizers left by earlier cells printed into the new cell's
    output. The new cell's output is its own, and it can still start threads of its own."""
    with pool.session() as session:
        assert session.run(noisy).status == "ok"
        result = session.run("import gc, threading, time\ntime.sleep(0.3)\ngc.collect()\n"
                             "t = threading.Thread(target=print, args=('mine',))\nt.start()\nt.join()")
        assert result.status == "ok" and result.stdout == "mine\n" and result.stderr == "", result


def test_replayed_cells_read_their_own_stdin(pool):
    with pool.session() as session:
        assert session.run("a = int(input())", "5\n").status == "ok"
        assert session.run("import sys\nb = int(sys.stdin.buffer.read())", "7").status == "ok"
        result = session.run("print(a + b + int(input()))", "30\n")
        assert result.stdout == "42\n", result


def test_random_draws_repeat_on_replay_and_follow_the_seed(pool):
    draw = "import random, numpy as np, sympy\nr = (random.random(), float(np.random.rand()), sympy.randprime(10**8, 10**9))\nprint(r)"
    outputs = []
    for seed in (11, 11, 12):
        with pool.session(seed=seed) as session:
            first = session.run(draw)
            again = session.run("print(r)\nprint(random.random())")
            assert first.status == again.status == "ok"
            assert again.stdout.splitlines()[0] == first.stdout.strip()
            outputs.append(again.stdout)
    assert outputs[0] == outputs[1] != outputs[2]


def test_tracebacks_name_the_cell_a_function_came_from(pool):
    with pool.session() as session:
        session.run("def inverse(n):\n    return 1 / n")
        result = session.run("inverse(0)")
        assert result.status == "error"
        assert 'File "<tool_code>", line 1' in result.stderr and 'File "<cell 1>", line 2, in inverse' in result.stderr
        assert "return 1 / n" in result.stderr and "runner.py" not in result.stderr


def test_a_poisoned_session_hurts_only_itself(pool):
    with pool.session() as poisoned, pool.session() as clean:
        assert poisoned.run("import builtins, sys, os\nbuiltins.print = None\nsys.modules.clear()\nos.chdir('/')").status == "ok"
        assert clean.run("x = 1").status == "ok"
        assert poisoned.run("print(1)").status == "error"
        result = clean.run("import os\nprint(x, os.getcwd())")
        assert result.status == "ok" and result.stdout == "1 /tmp\n", result
    assert pool.run("print(len('abc'))").stdout == "3\n"


def test_one_call_at_a_time_close_and_counts(pool):
    before = pool.health()["sessions"]
    session = pool.session()
    assert pool.health()["sessions"] == before + 1
    future = session.submit("import time\ntime.sleep(0.5)\nx = 1")
    with pytest.raises(RuntimeError, match="one call at a time"):
        session.submit("x")
    assert future.result().status == "ok"
    assert session.run("x").stdout == "1\n"
    session.close()
    session.close()  # idempotent
    assert session.closed and session.cells == () and pool.health()["sessions"] == before
    with pytest.raises(RuntimeError, match="closed session"):
        session.submit("x")


@pytest.mark.parametrize("kwargs, error", [
    (dict(replay=[("x = 1",)]), TypeError), (dict(replay=[("x = 1", None)]), TypeError),
    (dict(replay=["x = 1"]), TypeError), (dict(seed=-1), ValueError), (dict(seed=2 ** 63), ValueError),
    (dict(seed=1.5), ValueError)])
def test_bad_replay_or_seed_is_refused(pool, kwargs, error):
    with pytest.raises(error):
        pool.submit("1", **kwargs)


def test_replays_only_cells_that_ran():
    assert replays(ExecResult("ok", exit_code=0)) and replays(ExecResult("error", exit_code=1))
    assert not replays(ExecResult("error"))  # refused before it started (no exit code)
    for status in ("timeout", "memory", "output_limit", "killed", "sandbox_error"):
        assert not replays(ExecResult(status, exit_code=None))


def test_a_done_callback_may_submit_the_sessions_next_cell_but_not_wait(pool):
    """Callbacks run on the pool's reader thread (see test_sandbox_pool): ``session.run`` there
    would wait for that very thread and says so; ``session.submit`` of the next cell works."""
    with pool.session() as session:
        seen = {}

        def waits(_):
            try:
                session.run("x")
            except RuntimeError as error:
                seen["run"] = str(error)

        future = session.submit("import time\ntime.sleep(0.5)\nx = 41")
        future.add_done_callback(waits)
        future.add_done_callback(lambda _: seen.setdefault("next", session.submit("x + 1")))
        assert future.result().status == "ok"
        assert seen["next"].result().stdout == "42\n" and "use submit()" in seen["run"]
