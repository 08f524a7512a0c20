"""SandboxPool API, tool semantics, rendering, self-healing and the weaker isolation levels.

A call that must reach another status than a timeout runs in a pool whose deadline
(PATIENT_TIMEOUT_S) no load on the machine reaches; only calls that must time out run in a pool
with a short one (TIMEOUT_S). No test here measures how fast a call runs.
"""
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from rstar2_jax.sandbox import pool as pool_module
from rstar2_jax.sandbox import ExecResult, Executor, SandboxConfig, SandboxPool, render_result
from rstar2_jax.sandbox.result import rendered_stdout, truncate_middle, without_time


TIMEOUT_S = 1.0
PATIENT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(num_workers=2, timeout_s=PATIENT_TIMEOUT_S) as p:
        yield p


@pytest.fixture(scope="module")
def short_pool():
    with SandboxPool(num_workers=1, timeout_s=TIMEOUT_S) as p:
        yield p


# -- tool semantics ----------------------------------------------------------------------------
@pytest.mark.parametrize("code, stdout", [
    ("x = 6\nx * 7", "42\n"),                         # trailing expression: its repr
    ("'a' + 'b'", "'ab'\n"),                          # repr, not str
    ("print('shown')\n1 + 1", "shown\n"),             # something printed: no repr
    ("None", ""),                                     # None is not shown
    ("import fractions\nfractions.Fraction(1, 3) + fractions.Fraction(1, 6)", "Fraction(1, 2)\n"),
    ("def f():\n    return 3\nf()", "3\n"),
    ("for i in range(2):\n    i", ""),                # last statement is a loop, not an expression
    ("x = 1", ""),
])
def test_trailing_expression_rule(pool, code, stdout):
    result = pool.run(code)
    assert result.status == "ok", result
    assert result.stdout == stdout


def test_traceback_points_at_user_code_only(pool):
    result = pool.run("a = 1\nb = 0\nprint(a / b)")
    assert result.status == "error" and result.exit_code == 1
    assert 'File "<tool_code>", line 3, in <module>' in result.stderr
    assert "print(a / b)" in result.stderr and "ZeroDivisionError: division by zero" in result.stderr
    assert "runner.py" not in result.stderr


def test_calls_do_not_share_state(pool):
    # The scratch directory may also hold the top of an installation under /tmp (bound back).
    first = pool.run("import os\nbefore = sorted(os.listdir('.'))\nopen('secret.txt', 'w').write('x')\n"
                     "os.environ['LEAK'] = '1'\nprint(before, sorted(set(os.listdir('.')) - set(before)))")
    before, added = first.stdout.rsplit("] [", 1)
    assert added == "'secret.txt']\n"
    second = pool.run("import os\nprint(sorted(os.listdir('.')), os.environ.get('LEAK'))")
    assert second.stdout == f"{before}] None\n"


def test_rngs_are_reseeded_per_call(pool):
    code = "import random, numpy, sympy\nprint(random.random(), numpy.random.rand(), sympy.randprime(10**8, 10**9))"
    outputs = [r.stdout for r in pool.run_batch([code] * 6)]
    assert all(r for r in outputs)
    assert len(set(outputs)) == 6


def test_math_modules_are_usable(pool):
    code = ("import numpy as np, sympy as sp, math, itertools\n"
            "x = sp.Symbol('x')\n"
            "print(sp.solve(x**2 - 5*x + 6, x), int(round(np.linalg.det(np.array([[2., 1.], [1., 3.]])))),\n"
            "      math.comb(10, 3), len(list(itertools.permutations(range(4)))))")
    result = pool.run(code)
    assert result.status == "ok", result
    assert result.stdout == "[2, 3] 5 120 24\n"


def test_no_network_and_unprivileged(pool):
    result = pool.run("import os, socket\nprint(os.getuid() != 0, os.getpid())\n"
                      "print(sorted(n for _, n in socket.if_nameindex()))")
    lo, ifaces = result.stdout.splitlines()
    assert lo == "True 1"  # not root; PID 1 of its own namespace
    assert ifaces == "['lo']"


def test_installation_anywhere_is_importable(monkeypatch):
    """Modules first imported inside a call, wherever they are installed: package directories on
    PYTHONPATH inside private home directories (0750 under /tmp, 0700 under /var/tmp), and sympy
    itself imported from under /tmp, whose lazily imported submodules are what failed for a
    virtual environment under /tmp (the call's scratch tmpfs on /tmp hid them)."""
    import sympy

    home_tmp = tempfile.mkdtemp(dir="/tmp", prefix="rstar2-home-")
    home_var = tempfile.mkdtemp(dir="/var/tmp", prefix="rstar2-home-")  # 0700, as mkdtemp makes it
    os.chmod(home_tmp, 0o750)
    try:
        sites = []
        for home, name in ((home_tmp, "tmp"), (home_var, "var")):
            site = os.path.join(home, "site-packages")
            os.mkdir(site, 0o755)
            with open(os.path.join(site, f"probe_{name}.py"), "w") as f:
                f.write(f"VALUE = {name!r}\n")
            sites.append(site)
        os.symlink(os.path.dirname(sympy.__file__), os.path.join(sites[0], "sympy"))
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(sites))
        with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S) as pool:
            imports = pool.run("import sys\nlazy = 'sympy.assumptions.wrapper' not in sys.modules\n"
                               "import sympy, sympy.assumptions.wrapper, probe_tmp, probe_var\n"
                               f"print(lazy, sympy.__file__.startswith({sites[0]!r}), probe_tmp.VALUE, probe_var.VALUE)")
            read_only = pool.run(f"open({os.path.join(sites[0], 'new.py')!r}, 'w')")
            scratch = pool.run("import os\nopen('mine', 'w').close()\nprint(sorted(os.listdir('/tmp')))")
    finally:
        shutil.rmtree(home_tmp)
        shutil.rmtree(home_var)
    assert imports.stdout == "True True tmp var\n", imports
    assert read_only.status == "error" and "Read-only file system" in read_only.stderr, read_only
    # The scratch space is still private and writable; the installations under /tmp show in it:
    # the probe's, and this interpreter's when it lives under /tmp (a venv in /tmp/x shows as x).
    interpreter = {os.path.realpath(p).split(os.sep)[2] for p in (sys.prefix, sys.base_prefix)
                   if os.path.realpath(p).startswith("/tmp/")}
    expected = sorted({"mine", os.path.basename(home_tmp)} | interpreter)
    assert scratch.stdout == f"{expected}\n", scratch


def test_installation_that_calls_cannot_read_is_refused(monkeypatch, tmp_path):
    from rstar2_jax.sandbox.filesystem import installation_paths

    private = tmp_path / "private-site"
    private.mkdir(mode=0o700)
    monkeypatch.setattr("sys.path", sys.path + [str(private)])
    with pytest.raises(PermissionError, match=f"{private}.*not readable by other users"):
        installation_paths()
    monkeypatch.setattr("sys.path", sys.path + ["/"])
    with pytest.raises(ValueError, match="whole filesystem"):
        installation_paths()


def test_template_environment_is_built_not_inherited(monkeypatch):
    from rstar2_jax.sandbox.pool import template_environment

    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("PYTHONPATH", "relative/dir")
    env = template_environment()
    assert "HF_TOKEN" not in env and env.get("HOME") == os.environ.get("HOME")
    assert env["PYTHONPATH"].split(os.pathsep)[1] == os.path.abspath("relative/dir")


# -- API ---------------------------------------------------------------------------------------
def test_run_batch_keeps_submission_order_and_accepts_stdin_pairs(pool):
    calls = [f"import time\ntime.sleep({0.3 - 0.01 * i})\nprint({i})" for i in range(10)]
    calls += [("print(input()[::-1])", "abc\n")]
    results = pool.run_batch(calls)
    assert [r.stdout for r in results] == [f"{i}\n" for i in range(10)] + ["cba\n"]


@pytest.mark.parametrize("bad", [("code",), ("code", 3), ["code", ""], 42, ("a", "b", "c")])
def test_run_batch_rejects_malformed_calls(pool, bad):
    with pytest.raises(TypeError):
        pool.run_batch([bad])


def test_submit_returns_future_that_overlaps(pool):
    # Each call prints when it started and when it ended (the host's monotonic clock).
    code = "import time\nstart = time.monotonic()\ntime.sleep(2)\nprint(start, time.monotonic())"
    futures = [pool.submit(code) for _ in range(4)]
    assert not any(f.done() for f in futures)  # submit does not wait for the call
    spans = [tuple(map(float, f.result().stdout.split())) for f in futures]
    # They ran concurrently, not 4 x 2 s in a row: all four were running at one moment.
    assert max(start for start, _ in spans) < min(end for _, end in spans), spans


@pytest.mark.parametrize("calls, statuses", [(["1", "raise ValueError"], ("ok", "error")),
                                             (["import time\ntime.sleep(100)"], ("timeout",))])
def test_pool_is_an_executor_and_reports_counters(pool, short_pool, calls, statuses):
    p = short_pool if statuses == ("timeout",) else pool
    assert isinstance(p, Executor)
    before = p.stats()
    p.run_batch(calls)
    after = p.stats()
    assert after["calls"] - before["calls"] == len(calls) and after["completed"] - before["completed"] == len(calls)
    for status in ("ok", "error", "timeout"):
        assert after[status] - before[status] == (status in statuses)
    assert after["queue_wait_max_s"] >= after["queue_wait_p99_s"] >= after["queue_wait_p50_s"] >= 0
    health = p.health()
    assert health["healthy"] and health["live_workers"] == p.num_workers and health["in_flight"] == 0


def _voluntary_switches(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches"))


def test_output_a_byte_at_a_time_wakes_the_template_at_most_every_10_ms():
    """A call that wrote its output a byte at a time woke its template for every byte: 0.25-0.4 s
    of CPU per call in the template, outside the call's CPU cgroup. The template reads a stream
    that delivered little at most every 10 ms (two wakeups per stream and window: the window's
    end and the data), and still gets every byte."""
    with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S) as pool:
        pid = pool.health()["template_pids"][0]
        before = _voluntary_switches(pid)
        result = pool.run("import os, time\nfor _ in range(1000):\n    os.write(1, b'x')\n    os.write(2, b'y')\n"
                          "    time.sleep(0.001)")
        woken = _voluntary_switches(pid) - before
    assert result.status == "ok" and result.stdout == "x" * 1000 and result.stderr == "y" * 1000, result
    assert woken <= 4 * result.wall_s / 0.01 + 20, (woken, result.wall_s)


def _rss_of_uids(first: int, last: int) -> int:
    """Resident bytes of the processes whose real uid is in [first, last]."""
    total = 0
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f)
        except (OSError, ValueError):
            continue
        if first <= int(fields["Uid"].split()[0]) <= last and "VmRSS" in fields:
            total += int(fields["VmRSS"].split()[0]) << 10
    return total


def test_the_calls_of_a_pool_together_stay_under_its_memory_bound():
    """One batch of calls could hold cores x 8 x 1 GiB, as much as the whole host. Two calls of
    300 MB, each under its own 400 MB limit, in a pool bounded at 500 MB: the second one's
    memory (the first holds its own meanwhile) makes the kernel kill one of them."""
    mib = 1 << 20
    with SandboxPool(num_workers=1, slots_per_worker=2, timeout_s=PATIENT_TIMEOUT_S, memory_bytes=400 * mib,
                     pool_memory_bytes=500 * mib) as pool:
        assert pool.health()["memory_limit"].startswith("cgroup"), "this machine grants memory cgroups; see docs/sandbox.md"
        holder = pool.submit("import time\nx = b'x' * (300 << 20)\ntime.sleep(100)")
        uids = pool.health()["slot_uids"]
        give_up = time.monotonic() + 120  # a guard against a hang, not a measurement
        while _rss_of_uids(*uids) < 300 * mib and not holder.done() and time.monotonic() < give_up:
            time.sleep(0.05)
        second = pool.run("x = b'x' * (300 << 20)\nprint('held')")
    statuses = (holder.result().status, second.status)
    assert "memory" in statuses, (holder.result(), second)


def test_pool_memory_bound_leaves_each_template_a_whole_call():
    with pytest.raises(ValueError, match="pool_memory_bytes"):
        SandboxPool(num_workers=2, memory_bytes=1 << 30, pool_memory_bytes=(1 << 31) - 1)


def test_dead_template_fails_its_calls_and_is_replaced():
    with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S) as pool:
        victim = pool.health()["template_pids"][0]
        futures = [pool.submit("import time\ntime.sleep(100)") for _ in range(3)]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=60) for f in futures]
        assert [r.status for r in results] == ["sandbox_error"] * 3
        assert all("died" in r.detail for r in results)
        assert pool.run("print('back')").stdout == "back\n"  # queued until the replacement is up
        health = pool.health()
        assert health["healthy"] and health["template_pids"] != [victim]
        assert pool.stats()["respawns"] == 1


def _template_interpreter(monkeypatch, tmp_path, body: str) -> None:
    """Templates started through a shell script running ``body`` before the real interpreter."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))


def test_a_slow_template_start_is_waited_for_with_warnings(monkeypatch, tmp_path, caplog):
    """No deadline that load can reach fails the start: a template still starting after the
    warning interval is waited for, and the log says so."""
    monkeypatch.setattr(pool_module, "_STARTUP_WARN_S", 0.2)
    _template_interpreter(monkeypatch, tmp_path, "sleep 1")  # ready no sooner than 1 s in
    with caplog.at_level("WARNING", logger=pool_module.__name__):
        with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S) as pool:
            assert pool.run("print(6 * 7)").stdout == "42\n"
    warnings = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert warnings and warnings[0].startswith("sandbox pool: 0 of 1 templates ready after 0 s")


def test_a_template_that_dies_while_starting_fails_the_pool_after_three_tries(monkeypatch, tmp_path):
    _template_interpreter(monkeypatch, tmp_path, "exit 3")
    with pytest.raises(RuntimeError, match=r"template 0 exited 3 times before it was ready \(last exit code 3"):
        SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S)


def test_done_callbacks_may_submit_but_not_wait():
    """Callbacks run on the pool's reader thread: waiting there for another call would wedge
    it (nothing else delivers results), so run() says so; submit() works."""
    with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S) as pool:
        seen = {}

        def waits(_):
            try:
                pool.run("print(0)")
            except RuntimeError as error:
                seen["run"] = str(error)

        future = pool.submit("import time\ntime.sleep(1)\nprint(1)")  # not done before the callbacks are added
        future.add_done_callback(waits)
        future.add_done_callback(lambda _: seen.setdefault("chained", pool.submit("print(2)")))
        assert future.result().stdout == "1\n"
        assert seen["chained"].result().stdout == "2\n"
        assert "use submit()" in seen["run"]
        assert pool.run("print(3)").stdout == "3\n" and pool.health()["healthy"]


def test_close_from_a_done_callback_resolves_every_call():
    pool = SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S)
    templates = pool.health()["template_pids"]
    sleeping = [pool.submit("import time\ntime.sleep(100)") for _ in range(3)]
    first = pool.submit("import time\ntime.sleep(1)\nprint('x')")
    first.add_done_callback(lambda _: pool.close())
    assert first.result().stdout == "x\n"
    assert [f.result().status for f in sleeping] == ["sandbox_error"] * 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("1")
    assert not any(os.path.exists(f"/proc/{pid}") for pid in templates)


def test_close_resolves_unfinished_calls_and_refuses_new_ones():
    pool = SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S, slots_per_worker=1)
    futures = [pool.submit("import time\ntime.sleep(100)") for _ in range(3)]
    time.sleep(0.3)
    pool.close()
    results = [f.result(timeout=30) for f in futures]
    assert [r.status for r in results] == ["sandbox_error"] * 3
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("1")


def test_pool_starts_from_a_process_running_jax():
    import jax
    import jax.numpy as jnp

    assert float(jnp.ones(3).sum()) == 3.0  # XLA's thread pools are up in this process now
    # The templates would refuse to start (RuntimeError) if jax had leaked into them.
    with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S) as pool:
        result = pool.run("import sys\nprint('jax' in sys.modules)")
    assert result.stdout == "False\n"
    assert jax.device_count() >= 1


# -- weaker isolation levels (forced) -----------------------------------------------------------
def _children(pid):
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _only_the_zygote_left(pool) -> bool:
    template = pool.health()["template_pids"][0]
    zygote, = _children(template)  # the template's only child forks the calls
    return _children(zygote) == []


@pytest.mark.parametrize("level", ["uid", "none"])
def test_fallback_levels_contain_escapees_and_time_out(level):
    escapee = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(100)\n"
               "print(os.getpid())")
    with SandboxPool(num_workers=1, timeout_s=PATIENT_TIMEOUT_S, isolation=level) as pool, \
            SandboxPool(num_workers=1, timeout_s=TIMEOUT_S, isolation=level) as short:
        assert pool.health()["isolation"] == short.health()["isolation"] == level
        results = pool.run_batch([escapee, "print(7 * 6)"])
        assert [r.status for r in results] == ["ok", "ok"]
        assert results[1].stdout == "42\n"
        # A timed-out call and what it started are killed too.
        spinning = "import os\nif os.fork() == 0:\n    os.setsid()\nwhile True: pass"
        assert short.run(spinning).status == "timeout"
        # The setsid children did not survive their calls (the sweep follows the result).
        deadline = time.monotonic() + PATIENT_TIMEOUT_S
        while not (_only_the_zygote_left(pool) and _only_the_zygote_left(short)):
            assert time.monotonic() < deadline, "a call's setsid child outlived its call"
            time.sleep(0.05)
        if level == "uid":
            assert pool.run("import os\nprint(os.getuid())").stdout != "0\n"


def test_namespaces_refused_half_way_leave_the_template_as_it_was():
    # Seen as root on a Firecracker VM: a mount of the minimal root was refused after the pivot
    # into its scaffolding, the template fell back to the uid level inside that half-built root
    # (no /tmp) and every worker died. `auto` must try the namespaces where a refusal costs
    # nothing. The stand-in step changes this process (an environment variable for the mounts)
    # and is then refused; the level chosen must be the fallback, in an unchanged process.
    code = textwrap.dedent("""
        import os
        from rstar2_jax.sandbox import template

        def half_built(paths, slots):
            os.environ["HALF_BUILT"] = "1"
            raise PermissionError(1, "refused half-way")

        template._enter_namespaces = half_built
        level, pidns, netns = template.choose_level("auto", [], 1)
        print(level, "HALF_BUILT" in os.environ, pidns, len(netns))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["uid" if os.geteuid() == 0 else "none", "False", "None", "0"]


# -- rendering ---------------------------------------------------------------------------------
def test_render_success_format():
    r = ExecResult(status="ok", stdout="42\n", wall_s=0.123)
    assert render_result(r) == "Tool call success\nstdout: 42\nexecution time: 0.12s"
    assert render_result(r, show_time=False) == "Tool call success\nstdout: 42"


def test_render_failure_formats():
    tb = "Traceback (most recent call last):\nValueError: x\n"
    assert render_result(ExecResult(status="error", stderr=tb, exit_code=1, wall_s=0.05)) == (
        "Tool call failure\nstderr: Traceback (most recent call last):\nValueError: x\nexecution time: 0.05s")
    timeout = ExecResult(status="timeout", stdout="partial\n", wall_s=4.0, detail="exceeded the 4 s wall-clock limit")
    assert render_result(timeout) == ("Tool call failure\nreason: timeout (exceeded the 4 s wall-clock limit)\n"
                                      "stdout: partial\nexecution time: 4.00s")
    segv = ExecResult(status="killed", signal=11, wall_s=0.01)
    assert render_result(segv, show_time=False) == "Tool call failure\nreason: killed by signal SIGSEGV"
    exit3 = ExecResult(status="error", exit_code=3, wall_s=0.01)
    assert render_result(exit3, show_time=False) == "Tool call failure\nreason: exit code 3"


def test_without_time_drops_only_the_time_line():
    """Records keep the rendered response without its time, so that reruns write the same bytes;
    the output the call printed is kept, even a line that looks like the time."""
    printed = "execution time: 9.99s\nmore"
    for r in (ExecResult(status="ok", stdout="42\n", wall_s=0.123),
              ExecResult(status="error", stdout=printed, stderr="ValueError: x\n", exit_code=1, wall_s=3.0),
              ExecResult(status="ok", stdout="".join(f"line {i}\n" for i in range(500)), wall_s=1.5)):
        for max_chars in (1024, 200):
            untimed = without_time(render_result(r, max_chars=max_chars))
            assert untimed == render_result(r, max_chars=max_chars)[:len(untimed)]
            assert "execution time: 9.99s\nmore" in untimed or r.stdout != printed
            assert not untimed.endswith(f"execution time: {r.wall_s:.2f}s")
    assert without_time("Tool call success\nstdout: 42") == "Tool call success\nstdout: 42"


def test_rendered_stdout_reads_back_what_the_program_printed():
    """Only the stdout: not the stderr or time lines after it, several lines kept whole."""
    cases = [(ExecResult(status="ok", stdout="42\n", wall_s=0.1), "42"),
             (ExecResult(status="ok", stdout="1\n2\n", stderr="UserWarning: slow\n", wall_s=0.1), "1\n2"),
             (ExecResult(status="timeout", stdout="partial\n", wall_s=4.0), "partial"),
             (ExecResult(status="error", stderr="ValueError: x\n", exit_code=1, wall_s=0.1), "")]
    for result, printed in cases:
        for show_time in (True, False):
            assert rendered_stdout(render_result(result, show_time=show_time)) == printed, (result, show_time)


def test_render_truncates_middle_keeping_first_and_last_lines():
    r = ExecResult(status="ok", stdout="".join(f"line {i}\n" for i in range(1000)), wall_s=1.5)
    text = render_result(r, max_chars=300)
    assert len(text) == 300
    assert text.startswith("Tool call success\nstdout: line 0\n")
    assert text.endswith("line 999\nexecution time: 1.50s")
    assert "chars truncated)..." in text


@pytest.mark.parametrize("n, max_chars", [(10, 10), (1000, 100), (5000, 64), (101, 100)])
def test_truncate_middle_bounds(n, max_chars):
    text = "".join(chr(97 + i % 26) for i in range(n))
    out = truncate_middle(text, max_chars)
    assert len(out) <= max_chars
    if n <= max_chars:
        assert out == text
    else:
        head = out.split("\n...(")[0]
        tail = out.split(")...\n")[-1]
        assert text.startswith(head) and text.endswith(tail)
        assert int(out.split("\n...(")[1].split(" ")[0]) == n - len(head) - len(tail)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="status"):
        ExecResult(status="fine")
    # 3e6 s was accepted, and then every call killed its template (an OverflowError in poll)
    # while health() said healthy.
    for timeout_s in (0, -1, 3e6, float("inf"), float("nan"), "4"):
        with pytest.raises(ValueError, match="timeout_s"):
            SandboxConfig(timeout_s=timeout_s)
    with pytest.raises(ValueError, match="timeout_s"):
        SandboxPool(timeout_s=3e6)
    for name, value in (("cpu_s", 0), ("cpu_s", 2.5), ("memory_bytes", 1 << 70), ("memory_bytes", 1.5e9),
                        ("max_processes", True), ("slots_per_worker", 0)):
        with pytest.raises(ValueError, match=name):
            SandboxConfig(**{name: value})
    with pytest.raises(ValueError, match="isolation"):
        SandboxConfig(isolation="docker")
    with pytest.raises(ValueError, match="too small"):
        truncate_middle("x" * 100, 5)
