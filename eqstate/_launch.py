"""Starting N processes of one program on this machine, as a cluster scheduler would.

JAX's `jax.distributed.initialize()` needs no arguments under SLURM: it reads the
task's rank, the number of tasks and the first node from the environment that `srun`
sets. The launcher sets that same environment for N local processes (one "node",
127.0.0.1), and `JAX_COORDINATOR_ADDRESS` with a free port, so a program written for a
cluster runs here unchanged, and nothing on the cluster side knows about eqstate.
"""

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


# The environment `srun --ntasks=N` gives task `i` on one node, which JAX's SLURM
# detection reads (its job id only seeds a default port, overridden here).
_SLURM_JOB_ID = "0"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_environment(
    process_id: int,
    num_processes: int,
    port: int,
    cpu_devices: int | None = None,
) -> dict[str, str]:
    """The environment variables of local process `process_id` of `num_processes`.

    With `cpu_devices`, the process runs on the CPU with that many devices and Gloo
    for the collectives between processes (JAX's CPU backend needs one to span
    processes).
    """
    env = {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
        "SLURM_JOB_ID": _SLURM_JOB_ID,
        "SLURM_STEP_NODELIST": "127.0.0.1",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NTASKS": str(num_processes),
        "SLURM_PROCID": str(process_id),
        "SLURM_LOCALID": str(process_id),
    }
    if cpu_devices is not None:
        env.update(
            JAX_PLATFORMS="cpu",
            JAX_NUM_CPU_DEVICES=str(cpu_devices),
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        )
    return env


def _relay(stream: Any, prefix: str, out: Any, lock: threading.Lock) -> None:
    for line in stream:
        with lock:
            out.write(prefix + line)
            out.flush()


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    """Kills every process and the processes it started (its process group), also
    those of a process that has exited, then reaps them all."""
    for proc in procs:
        # Not yet reaped (see `_exit_code`): its id still names its group, and no
        # other, even after it exited.
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _exit_code(proc: subprocess.Popen) -> int | None:
    """The return code of `proc` (`-N` if killed by signal N), or `None` while it
    runs. It is not reaped, so `_kill` can still reach what it started."""
    waitid = getattr(os, "waitid", None)  # not on every platform (older macOS)
    if proc.returncode is not None or waitid is None:
        return proc.poll()
    try:
        info = waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped elsewhere
        return proc.poll()
    if info is None or info.si_pid == 0:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


@contextlib.contextmanager
def local_processes(
    command: Sequence[str],
    num_processes: int,
    *,
    cpu_devices: int | None = None,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    out: Any = None,  # a text stream; `sys.stdout` by default
    tag_lines: bool = True,
) -> Iterator[list[subprocess.Popen]]:
    """Starts `num_processes` copies of `command`, each in its own process group with
    the environment of [`process_environment`][], and relays their output to `out`
    (each line prefixed with `[i]`). On exit, every process still running is killed
    and every process is reaped, whatever happened in the block."""
    port = free_port() if port is None else port
    out = sys.stdout if out is None else out
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    relays: list[threading.Thread] = []
    try:
        for i in range(num_processes):
            proc = subprocess.Popen(
                list(command),
                env={
                    **os.environ,
                    **(env or {}),
                    **process_environment(i, num_processes, port, cpu_devices),
                },
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",  # A byte that is not UTF-8 must not stop the relay.
                bufsize=1,
                start_new_session=True,
            )
            procs.append(proc)
            assert proc.stdout is not None
            prefix = f"[{i}] " if tag_lines else ""
            relay = threading.Thread(
                target=_relay, args=(proc.stdout, prefix, out, lock), daemon=True
            )
            relay.start()
            relays.append(relay)
        yield procs
    finally:
        _kill(procs)
        for relay in relays:
            relay.join(timeout=5)


# After a process fails, how long the others get to end on their own before they are
# killed (`--grace`). A process waiting for the failed one in a collective often fails
# in turn, within milliseconds, and may be seen to exit first (the failed one is still
# being torn down): both are reported, so the report names the process that failed
# first.
_FAILURE_GRACE = 1.0


def wait_all(
    procs: Sequence[subprocess.Popen],
    timeout: float | None = None,
    grace: float = _FAILURE_GRACE,
) -> int:
    """Waits for every process. When one fails (non-zero exit), gives the others
    `grace` seconds (ending at `timeout` at the latest) to end, then kills those
    still running; at `timeout` seconds, kills them all. Returns the exit code of the
    first process seen to fail (124 on a timeout), else 0."""
    return _wait(procs, timeout, grace)[0]


def _wait(
    procs: Sequence[subprocess.Popen], timeout: float | None, grace: float
) -> tuple[int, dict[int, int], bool]:
    """`wait_all`, which also gives the return code of each process that failed, by
    rank, in the order they were seen to fail (none on success or on a timeout), and
    whether it killed a process still running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failed: dict[int, int] = {}
    grace_end = math.inf
    while True:
        codes = [_exit_code(proc) for proc in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0) and rank not in failed:
                failed[rank] = code
        if failed and grace_end == math.inf:
            grace_end = time.monotonic() + grace
            if deadline is not None:
                grace_end = min(grace_end, deadline)  # The grace ends at `timeout`.
        running = None in codes
        if failed:
            if not running or time.monotonic() > grace_end:
                _kill(procs)
                return next(iter(failed.values())), failed, running
        elif not running:
            _kill(procs)  # What they started and left running, then reap them.
            return 0, {}, False
        elif deadline is not None and time.monotonic() > deadline:
            _kill(procs)
            return 124, {}, True
        time.sleep(0.01 if failed else 0.05)


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m eqstate.launch",
        description=(
            "Run N processes of a JAX program on this machine, each with the "
            "environment `srun --ntasks=N` would give it, so that "
            "`jax.distributed.initialize()` finds its rank, the number of processes "
            "and the coordinator (127.0.0.1, a free port) without arguments."
        ),
    )
    parser.add_argument(
        "-n", "--num-processes", type=int, default=2, help="processes (default 2)"
    )
    parser.add_argument(
        "--cpu-devices",
        type=int,
        default=None,
        metavar="K",
        help="run on the CPU with K devices per process (Gloo between processes)",
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="kill all after this many seconds"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=_FAILURE_GRACE,
        metavar="SECONDS",
        help="after a process fails, how long the others get to end on their own "
        f"before they are killed (default {_FAILURE_GRACE:g})",
    )
    parser.add_argument(
        "-m",
        dest="module",
        default=None,
        help="run a module, as `python -m` (the arguments after it are the module's)",
    )
    parser.add_argument("program", nargs=argparse.REMAINDER, help="script and args")
    own, module, module_args = _split_at_module(
        list(sys.argv[1:] if argv is None else argv)
    )
    args = parser.parse_args(own)
    if args.num_processes < 1:
        parser.error("--num-processes must be at least 1")
    if args.cpu_devices is not None and args.cpu_devices < 1:
        parser.error("--cpu-devices must be at least 1")
    if args.timeout is not None and not args.timeout > 0:
        parser.error("--timeout must be a positive number of seconds")
    if not args.grace >= 0:
        parser.error("--grace must be a number of seconds, 0 or more")
    if module is not None:
        command = [sys.executable, "-c", _CHILD, "-m", module, *module_args]
    elif args.program:
        command = [sys.executable, "-c", _CHILD, *args.program]
    else:
        parser.error("give a script to run (or -m module)")
    try:
        with (
            _exit_on_termination(),
            local_processes(
                command, args.num_processes, cpu_devices=args.cpu_devices
            ) as procs,
        ):
            code, failed, killed = _wait(procs, args.timeout, args.grace)
    except KeyboardInterrupt:
        return 130
    return _exit_status(code, failed, args.timeout, killed)


# What each process runs in place of `python script.py` (or `python -m module`): the
# program, as Python runs it, except that a failure exits at once, without the exit
# handlers. JAX's `jax.distributed.shutdown`, run at exit, waits for the other
# processes, which may wait for this one in a collective: a failed process would
# never exit, and the launcher never learn that it failed. Inline, not a module of
# eqstate: importing the package would import JAX before the program sets its
# environment (`XLA_FLAGS`, say).
_CHILD = """
import os, runpy, sys, traceback

def run():
    if sys.argv[1] == "-m":
        sys.argv = sys.argv[2:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
        runpy.run_path(sys.argv[0], run_name="__main__")

def own_frames(tb):
    while tb is not None and (
        tb.tb_frame.f_code.co_filename == "<string>"
        or tb.tb_frame.f_globals.get("__name__") == "runpy"
    ):
        tb = tb.tb_next
    return tb

def exit_now(code):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

try:
    run()
except SystemExit as done:
    if done.code is None or done.code == 0:
        raise
    if not isinstance(done.code, int):
        print(done.code, file=sys.stderr)
    exit_now(done.code if isinstance(done.code, int) else 1)
except BaseException as error:
    traceback.print_exception(type(error), error, own_frames(error.__traceback__))
    exit_now(1)
"""


# Signals that stop the launcher from outside (`kill`, `timeout`, a scheduler, a
# closed terminal). Its processes run in sessions of their own, out of reach of
# signals sent to the launcher's group, so it must kill them itself.
_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


def _raise_exit(signum: int, frame: Any) -> None:
    # The rest of the cleanup must not be cut short by a second signal.
    for other in _TERMINATING:
        signal.signal(other, signal.SIG_IGN)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _exit_on_termination() -> Iterator[None]:
    """Turns the terminating signals into `SystemExit` (status 128 + N, as a shell
    reports it) in the `with` block, so that the launcher's cleanup (`finally`) kills
    its processes; restores the previous handlers after. Only in the main thread,
    the one Python delivers signals to, and not for a signal ignored already (as
    `nohup` ignores SIGHUP): the launcher goes on through it, as before."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {
        s: signal.signal(s, _raise_exit)
        for s in _TERMINATING
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


# The launcher's options that take a value in the next word.
_TAKES_VALUE = frozenset(
    {"-n", "--num-processes", "--cpu-devices", "--timeout", "--grace"}
)


def _split_at_module(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """`(launcher's arguments, module, module's arguments)` of a command line with
    `-m MODULE` (else `(argv, None, [])`): as with `python -m`, every word after the
    module's name is the module's, even one that looks like a launcher option."""
    i = 0
    while i < len(argv):
        word = argv[i]
        if word == "-m" and i + 1 < len(argv):
            return argv[:i], argv[i + 1], argv[i + 2 :]
        if word.startswith("-m") and len(word) > 2:
            return argv[:i], word[2:], argv[i + 1 :]
        if not word.startswith("-"):
            break  # A script: the rest is its own (argparse's REMAINDER).
        i += 2 if word in _TAKES_VALUE else 1
    return argv, None, []


def _exit_status(
    code: int, failed: dict[int, int], timeout: float | None, killed: bool
) -> int:
    """The launcher's exit status, `code` (the return code of the first process seen
    to fail, or 124 on a timeout), with a message saying which processes failed and
    how (`failed`: their return codes by rank, first seen first), and whether others
    were `killed`: a process killed by signal N (code -N) gives 128 + N, as a shell
    reports it."""
    if not failed:
        if code == 124:
            print(
                f"eqstate.launch: still running after --timeout {timeout:g} s; "
                "every process was killed",
                file=sys.stderr,
            )
        return code
    how = ", ".join(f"process {rank} {_how(c)}" for rank, c in failed.items())
    others = "; the others were killed" if killed else ""
    print(f"eqstate.launch: {how}{others}", file=sys.stderr)
    return code if code >= 0 else 128 - code


def _how(code: int) -> str:
    if code >= 0:
        return f"exited with status {code}"
    name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
    return f"was killed by signal {name}"
