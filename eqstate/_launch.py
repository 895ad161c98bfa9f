"""Starting N processes of one program on this machine, as a cluster scheduler would.

JAX's `jax.distributed.initialize()` needs no arguments under SLURM: it reads the
task's rank, the number of tasks and the first node from the environment that `srun`
sets. The launcher sets that same environment for N local processes (one "node",
127.0.0.1), and `JAX_COORDINATOR_ADDRESS` with a free port, so a program written for a
cluster runs here unchanged, and nothing on the cluster side knows about eqstate.
"""

import contextlib
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
    """Kills every process still running, and its children, then reaps them all."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


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


def wait_all(procs: Sequence[subprocess.Popen], timeout: float | None = None) -> int:
    """Waits for every process. As soon as one fails (non-zero exit), or `timeout`
    seconds pass, kills the others. Returns the first non-zero exit code (124 on a
    timeout), else 0."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        codes = [proc.poll() for proc in procs]
        failed = [code for code in codes if code not in (None, 0)]
        if failed:
            _kill(procs)
            return failed[0]
        if all(code == 0 for code in codes):
            return 0
        if deadline is not None and time.monotonic() > deadline:
            _kill(procs)
            return 124
        time.sleep(0.05)


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
    if module is not None:
        command = [sys.executable, "-m", module, *module_args]
    elif args.program:
        command = [sys.executable, *args.program]
    else:
        parser.error("give a script to run (or -m module)")
    try:
        with (
            _exit_on_termination(),
            local_processes(
                command, args.num_processes, cpu_devices=args.cpu_devices
            ) as procs,
        ):
            return _exit_status(wait_all(procs, args.timeout))
    except KeyboardInterrupt:
        return 130


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
_TAKES_VALUE = frozenset({"-n", "--num-processes", "--cpu-devices", "--timeout"})


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


def _exit_status(code: int) -> int:
    """The launcher's exit status for a process's return code: a process killed by
    signal N (code -N) gives 128 + N, as a shell reports it, and a message naming
    the signal."""
    if code >= 0:
        return code
    name = signal.Signals(-code).name if -code in signal.valid_signals() else -code
    print(f"eqstate.launch: a process was killed by signal {name}", file=sys.stderr)
    return 128 - code
