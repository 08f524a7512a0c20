"""What a user sees of `python -m rstar2_jax demo`: a first screen of the job's own lines only
(no line of JAX's backend probing, of transformers, none twice), and Ctrl-C as one line that
says how to resume. The job runs as a user's would: in a fresh interpreter without torch (as
after `pip install -r requirements.txt`), without the tests' JAX platform and device settings,
in its own session so that the interrupt reaches every process of it, as a terminal's Ctrl-C
does."""
import os
import re
import signal
import subprocess
import sys

import pytest

from rstar2_jax.toy.demo import RL_CHECKPOINT_EVERY, SFT_CHECKPOINT_EVERY

# `python -m rstar2_jax` in an interpreter where torch cannot be imported (transformers then
# reports it as not installed), with Ctrl-C handled as in a terminal. A test run started in the
# background by a non-interactive shell (`pytest &`) ignores SIGINT, and a child inherits that:
# the interrupt would then be lost and the job would run to its end.
WITHOUT_TORCH = ("import runpy, signal, sys; sys.modules['torch'] = None; "
                 "signal.signal(signal.SIGINT, signal.default_int_handler); "
                 "runpy.run_module('rstar2_jax', run_name='__main__', alter_sys=True)")
FIRST_SCREEN = 30


def _shown(raw: bytes) -> str:
    """What a terminal shows of one line of output: a progress bar redraws itself after "\r"."""
    return raw.decode().rstrip("\n").split("\r")[-1]


def _screen_until_first_step(fd: int) -> list[str]:
    """Reads output from ``fd`` until the SFT progress bar shows its first step done (its
    redraws share one line, so the bar is read as it is drawn, not line by line); returns the
    shown lines, the bar's last. By then the backend is probed, transformers imported, the data
    read and the train step compiled: all the lines of the first screen that can be noise."""
    lines, pending = [], b""
    while chunk := os.read(fd, 4096):
        *done, pending = (pending + chunk).split(b"\n")
        lines += [_shown(raw) for raw in done]
        if re.search(r" 1/\d+ \[", _shown(pending)):
            return lines + [_shown(pending)]
    return lines + [_shown(pending)]  # the job ended first; the tests say what it printed


@pytest.fixture(scope="module")
def interrupted_demo(tmp_path_factory):
    """Runs the tiny demo until its first SFT step is done, then interrupts it. Returns (the
    lines before the interrupt, the lines after it, the exit status, the output directory).

    A user's environment but for two settings: a fresh JAX cache (the test's own), and XLA:CPU's
    older loop emitters, which only change how fast XLA compiles (tests/conftest.py)."""
    d = tmp_path_factory.mktemp("screen")
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env |= {"JAX_COMPILATION_CACHE_DIR": str(d / "jax_cache"), "PYTHONUNBUFFERED": "1",
            "XLA_FLAGS": "--xla_cpu_use_fusion_emitters=false"}
    proc = subprocess.Popen(
        [sys.executable, "-c", WITHOUT_TORCH, "demo", "--tiny", f"out={d}/demo"], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        before = _screen_until_first_step(proc.stdout.fileno())
        os.killpg(proc.pid, signal.SIGINT)
        after = [_shown(raw) for raw in proc.stdout]
        status = proc.wait()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return before, after, status, d / "demo"


def test_first_screen_holds_only_the_jobs_lines(interrupted_demo):
    before, _, _, out = interrupted_demo
    assert any(f"] sft: toy data" in line for line in before), before  # the job started
    screen = [line for line in before[:FIRST_SCREEN] if line.strip()]
    for noise in ("Unable to initialize backend", "PyTorch was not found", "transformers", "absl"):
        assert not [line for line in screen if noise in line], (noise, screen)
    assert len(set(screen)) == len(screen), screen  # the SFT data is read and reported once
    # A line logged while the SFT progress bar is drawn is shown on its own line.
    assert not [line for line in screen if "%|" in line and "INFO " in line], screen
    assert any(line.startswith("INFO rstar2_jax.train.sft: SFT packed rows") for line in screen), screen


def test_ctrl_c_is_one_line_naming_how_to_resume(interrupted_demo):
    _, after, status, out = interrupted_demo
    assert status == 130, after
    text = [line for line in after if line.strip()]
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in text), text
    assert text[-1] == (f"interrupted; run the same command again to resume from the newest "
                        f"checkpoints in {out} (SFT saves every {SFT_CHECKPOINT_EVERY} steps, "
                        f"RL every {RL_CHECKPOINT_EVERY})")
