"""`python -m eqstate.launch -n N [--cpu-devices K] script.py [args ...]` (or
`-m module [args ...]`, as with `python -m`): runs N processes of a JAX program on
this machine, for development.

Each process gets the environment that SLURM's `srun --ntasks=N` gives a task on one
node, and `JAX_COORDINATOR_ADDRESS=127.0.0.1:<free port>`, so the program calls
`jax.distributed.initialize()` without arguments, exactly as it would on a cluster.
Their output is relayed with a `[i]` prefix per process. When one process fails, the
others get `--grace` seconds (1 by default) to end, then are killed, and the
launcher exits with its exit code (128 + N, as a shell reports it, for a process
killed by signal N). When the launcher itself is stopped
(Ctrl-C, SIGTERM or SIGHUP), it kills every process first.
"""

from ._launch import main


if __name__ == "__main__":
    raise SystemExit(main())
