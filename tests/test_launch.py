"""`python -m eqstate.launch` (`eqstate/_launch.py`): N processes of a program on this
machine, each with the environment a SLURM task gets; their output relayed; every
process and what it started killed when one fails, at the timeout, or when the
launcher is stopped."""

import contextlib
import io
import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest


def test_launcher_sets_each_process_environment_and_kills_the_rest_on_failure(
    tmp_path,
):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, sys, time\n"
        "rank = int(os.environ['SLURM_PROCID'])\n"
        "print('rank', rank, 'of', os.environ['SLURM_NTASKS'],\n"
        "      os.environ['JAX_COORDINATOR_ADDRESS'], os.environ['JAX_NUM_CPU_DEVICES'],\n"
        "      flush=True)\n"
        "printed = sys.argv[1] + '.rank0-printed'\n"
        "if rank == 1:\n"
        "    deadline = time.monotonic() + 30  # rank 0's line must be out first\n"
        "    while not os.path.exists(printed) and time.monotonic() < deadline:\n"
        "        time.sleep(0.01)\n"
        "    sys.exit(3)\n"
        "open(printed, 'w').close()\n"
        "time.sleep(120)\n"
    )
    command = [sys.executable, "-m", "eqstate.launch", "-n", "2", "--cpu-devices"]
    result = subprocess.run(
        [*command, "3", str(script), str(script)],
        capture_output=True,
        text=True,
        timeout=90,  # process 0 sleeps 120 s unless killed
        start_new_session=True,
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert result.stderr == (
        "eqstate.launch: process 1 exited with status 3; the others were killed\n"
    )
    lines = sorted(result.stdout.splitlines())
    assert lines[0].startswith("[0] rank 0 of 2 127.0.0.1:") and lines[0].endswith(" 3")
    assert lines[1].startswith("[1] rank 1 of 2 127.0.0.1:")
    # Process 0 was sleeping: the launcher killed it rather than wait two minutes.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True)
    assert str(script) not in ps.stdout


def test_launcher_passes_every_word_after_a_module_to_the_module(tmp_path):
    # As with `python -m`: `-n 3` after the module is the module's, not the launcher's.
    (tmp_path / "show_args.py").write_text(
        "import os, sys\nprint('args', os.environ['SLURM_PROCID'], sys.argv[1:])\n"
    )
    command = [sys.executable, "-m", "eqstate.launch", "-n", "1", "--timeout", "60"]
    command += ["-m", "show_args", "--lr", "3", "-n", "3"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stdout + result.stderr
    lines = [line for line in result.stdout.splitlines() if "args" in line]
    assert lines == ["[0] args 0 ['--lr', '3', '-n', '3']"]


def test_launcher_reports_a_process_killed_by_a_signal_as_a_shell_does(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        "import os, signal, time\n"
        "if os.environ['SLURM_PROCID'] == '1':\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(120)\n"
    )
    command = [sys.executable, "-m", "eqstate.launch", "-n", "2", str(script)]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert result.returncode == 128 + signal.SIGKILL, result.stdout + result.stderr
    assert "killed by signal SIGKILL" in result.stderr
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True)
    assert str(script) not in ps.stdout


@contextlib.contextmanager
def _launched_job(tmp_path, seconds, prefix=()):
    """A launcher, run after the command `prefix` if given, running two processes
    that sleep for `seconds`, once both have started: `(launcher, their pids)`.
    Every process is killed at the end."""
    script = tmp_path / "job.py"
    script.write_text(
        "import os, pathlib, time\n"
        "pid = pathlib.Path(__file__).parent / f\"pid-{os.environ['SLURM_PROCID']}\"\n"
        "pid.write_text(str(os.getpid()))\n"
        f"time.sleep({seconds})\n"
    )
    command = [sys.executable, "-m", "eqstate.launch", "-n", "2", "--timeout", "90"]
    launcher = subprocess.Popen(
        [*prefix, *command, str(script)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    pid_files = [tmp_path / f"pid-{i}" for i in range(2)]
    children: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not all(f.exists() and f.read_text() for f in pid_files):
            assert time.monotonic() < deadline, "the processes did not start"
            assert launcher.poll() is None, "the launcher exited early"
            time.sleep(0.1)
        children = [int(f.read_text()) for f in pid_files]
        yield launcher, children
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(timeout=10)


# Runs the command after it with the default action for SIGTERM and SIGHUP, which a
# test run under `nohup` (ignoring SIGHUP) would otherwise pass on to the launcher.
_DEFAULT_ACTIONS = (
    sys.executable,
    "-c",
    "import os, signal, sys\n"
    "for signum in (signal.SIGTERM, signal.SIGHUP):\n"
    "    signal.signal(signum, signal.SIG_DFL)\n"
    "os.execv(sys.argv[1], sys.argv[1:])\n",
)


@pytest.mark.parametrize("signum", (signal.SIGTERM, signal.SIGHUP))
def test_launcher_stopped_by_a_signal_kills_its_processes(tmp_path, signum):
    with _launched_job(tmp_path, 120, _DEFAULT_ACTIONS) as (launcher, children):
        launcher.send_signal(signum)
        status = launcher.wait(timeout=30)
        # The launcher reaped them, so they are gone, not zombies.
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert status == 128 + signum  # as a shell reports it


def test_launcher_ignoring_sighup_as_under_nohup_goes_on_through_it(tmp_path):
    # As `nohup` does: ignore SIGHUP, then run the command (which inherits that).
    # Not `preexec_fn`, which forks this multithreaded process.
    ignoring_sighup = ("sh", "-c", 'trap "" HUP; exec "$@"', "sh")
    with _launched_job(tmp_path, 3, ignoring_sighup) as (launcher, _):
        launcher.send_signal(signal.SIGHUP)
        assert launcher.wait(timeout=60) == 0  # the job ran to its end


def test_launcher_reports_a_process_that_fails_a_moment_after_another(tmp_path):
    # A process waiting for a failed one in a collective fails in turn, and may be
    # seen to exit first, while the failed one is still being torn down: the report
    # must name both, not only the one seen first. Here process 0 fails once the
    # others have started, processes 1 and 2 fail once it has, and process 3
    # succeeds. A long grace: however slow the machine, none is killed first.
    result = _launch_script(
        tmp_path,
        "import os, pathlib, sys, time\n"
        "def wait_for(n, pattern):\n"
        "    deadline = time.monotonic() + 60  # none is left behind if one hangs\n"
        "    while len(list(pathlib.Path.cwd().glob(pattern))) < n:\n"
        "        assert time.monotonic() < deadline\n"
        "        time.sleep(0.01)\n"
        "rank = int(os.environ['SLURM_PROCID'])\n"
        "if rank == 0:\n"
        "    wait_for(3, 'started-*')\n"
        "    pathlib.Path('failed').touch()\n"
        "    sys.exit(2)\n"
        "pathlib.Path(f'started-{rank}').touch()\n"
        "if rank == 3:\n"
        "    sys.exit(0)\n"
        "wait_for(1, 'failed')\n"
        "sys.exit(3)\n",
        "-n",
        "4",
        "--grace",
        "60",
    )
    how = re.fullmatch(r"eqstate\.launch: (.*)\n", result.stderr)
    assert how is not None, result.stdout + result.stderr
    failures = re.findall(r"process (\d) exited with status (\d)", how[1])
    assert sorted(failures) == [("0", "2"), ("1", "3"), ("2", "3")], how[1]
    assert "process 3" not in how[1]
    assert result.returncode == int(failures[0][1])  # the first seen to fail
    assert "the others were killed" not in how[1]  # none was left to kill


def _launch_script(tmp_path, source, *options, timeout=90):
    """Runs `source` as a script under the launcher with `options`; the result."""
    script = tmp_path / "job.py"
    script.write_text(source)
    command = [sys.executable, "-m", "eqstate.launch", *options, str(script)]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=timeout,
        start_new_session=True,
        cwd=tmp_path,
    )


def test_launcher_stops_a_job_whose_process_raises_while_the_other_waits_for_it(
    tmp_path,
):
    # At exit, JAX's `jax.distributed.shutdown` of the failed process waits for the
    # other, which waits for it in a collective: the failure must end the job at once,
    # not after JAX's timeouts (the heartbeat's 100 s, the shutdown's 300 s): the
    # launch's own is 90 s.
    result = _launch_script(
        tmp_path,
        "import jax\n"
        "jax.distributed.initialize()\n"
        "import jax.numpy as jnp\n"
        "from jax.experimental import multihost_utils\n"
        "multihost_utils.sync_global_devices('started')\n"
        "if jax.process_index() == 1:\n"
        "    raise RuntimeError('rank 1 failed')\n"
        "multihost_utils.sync_global_devices('never reached by rank 1')\n",
        "-n",
        "2",
        "--cpu-devices",
        "1",
    )
    assert result.returncode == 1, result.stdout + result.stderr
    assert "process 1 exited with status 1" in result.stderr
    # The traceback starts in the program, as `python job.py` shows it.
    lines = [line for line in result.stdout.splitlines() if line.startswith("[1]")]
    tail = lines[lines.index("[1] Traceback (most recent call last):") :]
    assert "job.py" in tail[1] and tail[-1] == "[1] RuntimeError: rank 1 failed"
    assert "runpy" not in result.stdout and "<string>" not in result.stdout


def test_launcher_kills_what_a_failed_process_started_and_relays_any_bytes(tmp_path):
    helper = tmp_path / "helper-pid"
    result = _launch_script(
        tmp_path,
        "import os, subprocess, sys, time\n"
        "rank = os.environ['SLURM_PROCID']\n"
        "sys.stdout.buffer.write(b'caf\\xe9 from ' + rank.encode() + b'\\n')\n"
        "sys.stdout.flush()\n"
        "if rank == '1':\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(helper)!r}, 'w').write(str(p.pid))\n"
        "    sys.exit(3)\n"
        "time.sleep(120)\n",
        "-n",
        "2",
    )
    assert result.returncode == 3, result.stdout + result.stderr
    assert "process 1 exited with status 3" in result.stderr
    assert "[1] caf\ufffd from 1" in result.stdout  # a byte that is not UTF-8
    assert _ended(int(helper.read_text()))


def test_launcher_finds_modules_next_to_the_script_and_ends_what_it_left(tmp_path):
    (tmp_path / "sibling.py").write_text("VALUE = 42\n")
    helper = tmp_path / "helper-pid"
    result = _launch_script(
        tmp_path,
        "import os, subprocess, sys, sibling\n"
        "print('sibling', sibling.VALUE, sys.argv[1:], __name__, flush=True)\n"
        "if os.environ['SLURM_PROCID'] == '0':\n"
        "    p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
        f"    open({str(helper)!r}, 'w').write(str(p.pid))\n",
        "-n",
        "2",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[0] sibling 42 [] __main__" in result.stdout
    assert _ended(int(helper.read_text()))


def _ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie that no one reaped (its
    parent ended first, and in a container, process 1 may not reap orphans)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = pathlib.Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize(
    "options, message",
    [
        (("--cpu-devices", "0"), "--cpu-devices must be at least 1"),
        (("--timeout", "0"), "--timeout must be a positive number"),
        (("--timeout", "-1"), "--timeout must be a positive number"),
        (("--grace", "-1"), "--grace must be a number of seconds, 0 or more"),
    ],
)
def test_launcher_refuses_options_out_of_range(tmp_path, options, message):
    result = _launch_script(tmp_path, "print('ran')\n", *options)
    assert result.returncode == 2 and message in result.stderr
    assert "ran" not in result.stdout


def test_launcher_says_when_it_stopped_a_job_at_its_timeout(tmp_path):
    result = _launch_script(tmp_path, "import time\ntime.sleep(60)\n", "--timeout", "2")
    assert result.returncode == 124
    assert "still running after --timeout 2 s" in result.stderr


def test_launcher_stops_at_its_timeout_within_the_grace_after_a_failure():
    # After a failure the others get `grace` seconds to end, but never past `timeout`.
    from eqstate._launch import local_processes, wait_all

    source = (
        "import os, sys, time\n"
        "if os.environ['SLURM_PROCID'] == '0':\n"
        "    sys.exit(3)\n"
        "time.sleep(60)\n"
    )
    with local_processes([sys.executable, "-c", source], 2, out=io.StringIO()) as procs:
        procs[0].wait(timeout=30)
        start = time.monotonic()
        code = wait_all(procs, timeout=0.2, grace=600.0)
        elapsed = time.monotonic() - start
        assert procs[1].returncode is not None  # killed, and reaped
    assert code == 3
    assert elapsed < 60  # the grace would take 600 s; a loaded machine takes 1
