"""Runs the peer benchmarks and writes the results page, `docs/benchmarks.md`.

Run with `python -m benchmarks.report` (about ten minutes on two cores; install the
peers first with `pip install -e '.[dev,bench]'`). `--quick` takes few rounds and the
small sizes only, and prints the page instead of writing it unless `--output` is given:
it is a smoke test for CI, not a measurement.
"""

import argparse
import os
import pathlib
import subprocess
import time
import warnings

import jax

from . import checkpointed, peers
from ._timing import machine, Timing


_PAGE = pathlib.Path(__file__).parent.parent / "docs" / "benchmarks.md"

_PEERS = (peers.BRAINSTATE, peers.NNX, peers.NNX_CACHED, peers.NNX_TREE)

_SYSTEMS = (
    ("eqstate", "eqstate", "this library"),
    ("brainstate", "brainstate", "optional: `bench` extra"),
    ("Flax NNX", "flax", "optional: `bench` extra"),
    ("Equinox", "equinox", "a dependency of eqstate"),
    ("plain JAX", "jax", "the floor"),
    ("XLA runtime", "jaxlib", ""),
    ("optax", "optax", "workload 4"),
)


def _num(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def _cells(
    row: peers.Row, timing: Timing | None = None, *, reason_below: bool = False
) -> list[str]:
    t = row.timing if timing is None else timing
    if t is None:
        # A long reason in a cell widens the table past the page: the section says it.
        note = row.note.split(":", 1)[0] + " (see below)" if reason_below else row.note
        return [note or "-", "", ""]
    ratio = "" if row.ratio is None else f"{row.ratio:.2f}"
    return [_num(t.median), f"{_num(t.min)}-{_num(t.max)}", ratio]


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def _git_revision() -> str:
    try:
        root = pathlib.Path(__file__).parent.parent
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""
    return f"commit {rev}" + (" with local changes" if dirty else "")


def _by(table: peers.Table) -> dict[tuple[str, str], peers.Row]:
    return {(row.group, row.system): row for row in table.rows}


def _groups(table: peers.Table) -> list[str]:
    return list(dict.fromkeys(row.group for row in table.rows))


# eqstate's rows and the peer rows each is compared with, per workload.
_COMPARED = {
    "step": {peers.EQSTATE: (*_PEERS, peers.EQUINOX)},
    "first_call": {peers.EQSTATE: (*_PEERS, peers.EQUINOX)},
    "ensemble": {
        "eqstate vmap_new_states": (
            "brainstate vmap_new_states",
            "NNX split_rngs + vmap",
        ),
        "eqstate jit(vmap_new_states)": (
            peers.BRAINSTATE_JIT_BUILD,
            peers.NNX_JIT_BUILD,
        ),
    },
    "train": {peers.EQSTATE: (*_PEERS, "Equinox eqx.nn.BatchNorm")},
}

# Below this ratio of medians a difference is reported as within the noise.
_NOISE = 1.10


def _slower_rows(table: peers.Table) -> tuple[list[str], list[str]]:
    """Where eqstate's median is above a peer's, in words: by more than `_NOISE`, and
    by less."""
    rows = _by(table)
    slower, close = [], []
    for group in _groups(table):
        for ours_name, theirs_names in _COMPARED[table.name].items():
            ours = rows.get((group, ours_name))
            if ours is None or ours.timing is None:
                continue
            for name in theirs_names:
                theirs = rows.get((group, name))
                if theirs is None or theirs.timing is None:
                    continue
                a, b = ours.timing.median, theirs.timing.median
                if a <= b:
                    continue
                where = _LABELS[table.name] + (f" {group}" if group else "")
                line = (
                    f"{where}: {ours_name} {_num(a)} against {name} {_num(b)} "
                    f"{table.unit} ({a / b:.2f}x)"
                )
                (slower if a > _NOISE * b else close).append(line)
    return slower, close


_LABELS = {
    "step": "1. step, N =",
    "first_call": "2. first call, N =",
    "ensemble": "3. ensemble, K =",
    "train": "4. training step",
}


def _ratio_range(rows: list[peers.Row]) -> str:
    ratios = [row.ratio for row in rows if row.ratio is not None]
    if not ratios:
        return "n/a"
    lo, hi = min(ratios), max(ratios)
    return f"{lo:.2f}x" if f"{lo:.2f}" == f"{hi:.2f}" else f"{lo:.2f}x-{hi:.2f}x"


def _fastest_peer(table: peers.Table, group: str, names: tuple[str, ...]) -> str:
    rows = _by(table)
    timed = [
        rows[(group, n)]
        for n in names
        if (group, n) in rows and rows[(group, n)].timing is not None
    ]
    if not timed:
        return "no peer"
    best = min(timed, key=lambda r: r.timing.median)  # type: ignore[union-attr]
    return f"{best.system} ({best.ratio:.2f}x)"


def _step_section(table: peers.Table) -> str:
    lines = []
    for row in table.rows:
        lines.append([row.group, row.system, *_cells(row)])
    body = _table(["N", "system", "median us/call", "min-max", "x floor"], lines)
    ours = [r for r in table.rows if r.system == peers.EQSTATE]
    peer_names = (*_PEERS, peers.EQUINOX)
    best = "; ".join(
        f"N = {g}: {_fastest_peer(table, g, peer_names)}" for g in _groups(table)
    )
    return f"""## 1. A jitted step touching N states

Each call updates N states of shape `(4,)` (`s = 0.5 * s + x`) and returns `x.sum()`.

- **plain JAX (floor)**: `jax.jit` of the hand-written pure function, taking and
  returning a dict of N arrays;
- **eqstate**: `eqstate.transform.jit(step)`, where `step` closes over N
  `ShortTermState`s and writes `s.value`;
- **brainstate**: the same code with `brainstate.ShortTermState` and
  `brainstate.transform.jit`;
- **NNX**: a module holding an `nnx.List` of N `nnx.Variable`s, with `nnx.jit`
  (default graph mode), `nnx.cached_partial(nnx.jit(step), module)`, and
  `nnx.jit(step, graph=False)` (tree mode);
- **Equinox**: a module holding N `eqx.nn.StateIndex`es and its `eqx.nn.State`,
  threaded through `eqx.filter_jit(step)(model, state, x)`.

{body}

eqstate's time is {_ratio_range(ours)} the floor's over these N. The fastest peer at each
N: {best}.
"""


def _first_call_section(table: peers.Table) -> str:
    lines = []
    for row in table.rows:
        per_state = row.extra.get("per_state")
        per = "" if per_state is None else _num(per_state.median)
        lines.append([row.group, row.system, *_cells(row), per])
    body = _table(
        ["N", "system", "median ms", "min-max", "x floor", "median ms per state"],
        lines,
    )
    ours = [r for r in table.rows if r.system == peers.EQSTATE]
    return f"""## 2. First call: trace and compile

The same steps as in 1, each built afresh (new states, new function) and called once:
the time covers tracing, lowering, XLA compilation and one run. The systems take
turns, after one untimed turn each.

{body}

eqstate's first call is {_ratio_range(ours)} the floor's. XLA compilation is most of
it for every system, so the systems differ mainly in tracing; compilation grows with
the number of outputs (one per written state).
"""


def _ensemble_section(table: peers.Table) -> str:
    lines = []
    for row in table.rows:
        runs = row.extra.get("runs")
        lines.append(
            [
                row.group,
                row.extra.get("mode", ""),
                row.system,
                *_cells(row, reason_below=row.note.startswith("unsupported")),
                "" if runs is None else str(runs),
            ]
        )
    body = _table(
        [
            "K",
            "mode",
            "system",
            "median ms/build",
            "min-max",
            "x floor",
            "constructor runs per build",
        ],
        lines,
    )
    eager = [r for r in table.rows if r.system == "eqstate vmap_new_states"]
    jitted = [r for r in table.rows if r.system == "eqstate jit(vmap_new_states)"]
    unsupported = [
        r for r in table.rows if r.note.startswith("unsupported") and r.group
    ]
    note = ""
    if unsupported:
        names = " and ".join(sorted({r.system for r in unsupported}))
        why = unsupported[0].note.removeprefix("unsupported: ")
        note = f"\n\n{names} is unsupported: {why}."
    return f"""## 3. Building an ensemble of K MLPs

K two-layer MLPs (16-64-1: four parameter arrays), each lane initialised with its own
normal draw. Eager rows are compared with `eqx.filter_vmap(make_arrays)(keys)`, jitted
rows with `eqx.filter_jit(eqx.filter_vmap(make_arrays))(keys)`, where `make_arrays`
builds the same four arrays from a key.

- **eqstate**: `eqstate.transform.vmap_new_states(MLP, axis_size=K)()`, the `MLP`
  drawing from `eqstate.random.normal`; and the same under `eqstate.transform.jit`
  (fresh handles each call);
- **brainstate**: `brainstate.transform.vmap_new_states(ctor, axis_size=K)()`, with
  `brainstate.random.normal` (its `fun` must return JAX values, so the model leaves
  by a side effect); and the same under `brainstate.transform.jit`;
- **NNX**: `nnx.split_rngs(splits=K)` around `nnx.vmap(create)`, called with an
  `nnx.Rngs`; and the same under `nnx.jit`.

{body}

eqstate's eager build is {_ratio_range(eager)} the eager floor, and its jitted build
{_ratio_range(jitted)} the jitted floor. "Constructor runs" counts how often the
user's constructor body ran in one steady-state build: an eager build runs it under
`vmap` every time; a jitted build does not run it at all once compiled.{note}
"""


def _train_section(table: peers.Table) -> str:
    lines = [[row.system, *_cells(row)] for row in table.rows]
    body = _table(["system", "median us/step", "min-max", "x floor"], lines)
    rows = _by(table)
    ours = rows.get(("", peers.EQSTATE))
    ours_text = (
        f"eqstate's step is {ours.ratio:.2f}x the floor's"
        if ours is not None and ours.ratio is not None
        else "eqstate did not run"
    )
    return f"""## 4. A training step of a BatchNorm MLP

Linear(32, 64), BatchNorm(64) in training mode, ReLU, Linear(64, 1) on a batch of 128,
mean squared error, `optax.adam(1e-3)`. Every system starts from the same weights and
data, and its first three losses are checked against the floor's.

- **plain JAX (floor)**: dicts of parameters and batch statistics, one `jax.jit` of
  loss, `jax.value_and_grad`, `optax` update;
- **eqstate**: `eqstate.nn.BatchNorm`, and inside one `eqstate.transform.jit`:
  `eqstate.transform.value_and_grad(loss, grad_states=eqstate.ParamState)`, then
  `eqstate.values_of(model, eqstate.ParamState)`, the `optax` update and
  `eqstate.assign`; the optimiser state is an argument and a result;
- **eqstate, optax outside jit**: the pattern of `tests/test_end_to_end_rnn.py`: only
  `value_and_grad` is jitted, and `values_of`, `optax` and `assign` run eagerly;
- **brainstate**: `brainstate.nn.BatchNorm0d` under `brainstate.environ.context(fit=True)`,
  `brainstate.transform.grad(..., grad_states=..., return_value=True)` and the same
  `optax` update, inside `brainstate.transform.jit`;
- **NNX**: `nnx.BatchNorm`, `nnx.Optimizer(model, tx, wrt=nnx.Param)`,
  `nnx.value_and_grad` and `optimizer.update(model, grads)` inside `nnx.jit`, as
  `nnx.cached_partial`, and in tree mode (`graph=False`);
- **Equinox**: `eqx.nn.BatchNorm(..., mode="batch")` and `eqx.nn.State`, under
  `jax.vmap(..., axis_name="batch")`, `eqx.filter_value_and_grad` and the `optax`
  update inside `eqx.filter_jit`.

{body}

{ours_text}.
"""


def _versions_section() -> str:
    found = peers.software()
    lines = []
    for label, dist, role in _SYSTEMS:
        version = found.get(dist)
        if version is None:
            reason = peers.PEER_ERRORS.get(dist)
            version = "missing" + (f" ({reason})" if reason else "")
        elif dist == "eqstate":
            rev = _git_revision()
            version += f" ({rev})" if rev else ""
        lines.append([label, f"`{dist}`", version, role])
    return _table(["system", "distribution", "version", "role"], lines)


_EXPLANATIONS = """### Where the time goes

These explanations come from profiling each system with `cProfile` while preparing this
page (jax 0.10.2, brainstate 0.5.4, flax 0.12.8, equinox 0.13.8); the tables above are
the measurement.

**Per call (1, 4).** The floor is one `jax.jit` call: JAX's C++ dispatch flattens the
dict of arrays, finds the executable and runs it. The systems add Python work:

- **eqstate**: `eqstate.transform.jit` keeps, per compiled function, a *plan*: the ids
  of the states it reads and writes. A steady-state call reads their values from the
  world with one dict lookup each, makes one `jax.jit` call with them (so JAX's C++
  dispatch does the flattening), and stores the written values back; nothing else
  runs per state.
- **brainstate**: each call reads every state through `State.value` (with trace-validity
  checks and read hooks), checks that the compiled trace is not stale by computing the
  abstract value of every state (`_compilation_is_stale`), and writes every state back
  through `State.__setattr__` and its write hooks (`assign_state_vals_v2`).
- **NNX**: `nnx.jit` flattens the module graph (`_graph_flatten`) before the call and
  rebuilds it after (`_graph_unflatten`), visiting every `Variable`.
  `nnx.cached_partial` caches the graph but still updates each `Variable` through
  `set_raw_value` with its trace checks; tree mode flattens the module as a PyTree,
  checks it for aliases and applies the updates `Variable` by `Variable`.
- **Equinox**: `eqx.filter_jit` splits its arguments into arrays and static parts by
  flattening the model and the `eqx.nn.State` on every call (`hashable_partition`),
  then recombines the outputs with the static parts.

**First call (2).** XLA compilation takes about the same time for every system, since
they compile essentially the same program. eqstate traces twice: `StatefulFunction`
traces the function once to find its states, then `jax.jit` traces the plan's body,
which evaluates that jaxpr again equation by equation (`jax.core.eval_jaxpr` in
`Trace.run`); brainstate also traces twice (its `make_jaxpr`, then `jax.jit`).
Timing the phases separately at N = 1000, in two runs: the floor traced in 0.50-0.59 s
and lowered in 0.27-0.29 s; eqstate's stateful trace took 0.52 s and its whole trace
and lowering 1.21-1.38 s; both compiled in 1.8-1.9 s. The second trace, 0.3-0.6 ms
per state, is eqstate's extra cost over the floor on a first call, and why NNX, which
traces once inside `nnx.jit`, can come out ahead on a first call. It can be removed:
binding the traced jaxpr as a single equation (JAX's internal `eval_jaxpr_p`, which
`lax.scan` uses) instead of re-evaluating it took the second trace of a 1000-state
jaxpr from 192 ms to 33 ms in an experiment, with lowering and compilation unchanged.
(Writing NNX variables as `v[...] = value`, the spelling NNX's deprecation warning
suggests, made NNX's first call at N = 1000 about ten times slower, 25 s against 2.7 s
with `v.set_value(value)`: under a trace it reads `getattr(tracer, "sharding", None)`,
and JAX builds that `AttributeError`'s message by scanning the whole trace. The
benchmark uses `set_value`.)

**Ensembles (3).** Eager `vmap_new_states` runs the constructor under
`eqx.filter_vmap`, operation by operation, as the eager floor does. Its extra cost is
in the keys: each `eqstate.random.normal` draw splits the lane's key, so the two draws
dispatch two vmapped `jax.random.split`s eagerly where the floor dispatches one, and
the call splits the default key twice more outside the `vmap`. brainstate runs
the constructor twice per call (a probe that finds its random states, then the mapped
pass). Under `jit` all of this is compiled away: eqstate makes fresh handles from the
compiled function's outputs, so a build costs one `jax.jit` dispatch plus creating and
registering four handles, and the compiled random draws dominate for eqstate and the
jitted floor alike. brainstate's `jit` cannot return states created inside it
(their values are tracers once the trace ends). The first jitted build of every system
is dominated by XLA compiling the vmapped random draws: several seconds on this
machine, for every system alike.

**Training step (4).** The compiled programs are essentially the same, so the
differences are the per-call overheads of 1. Running `optax` eagerly, outside the
compiled function (the "optax outside jit" row, the pattern of
`tests/test_end_to_end_rnn.py`), pays one dispatch per array operation of the Adam
update: put the update inside `eqstate.transform.jit`, as in the "eqstate" row.
"""


def _analysis(tables: list[peers.Table]) -> str:
    slower: list[str] = []
    close: list[str] = []
    for table in tables:
        a, b = _slower_rows(table)
        slower += a
        close += b
    parts = []
    if slower:
        parts.append(
            "In this run eqstate's median was more than "
            f"{(_NOISE - 1) * 100:.0f}% above a peer's on these rows:\n\n"
            + "\n".join(f"- {line}" for line in slower)
        )
    else:
        parts.append(
            "In this run eqstate's median was never more than "
            f"{(_NOISE - 1) * 100:.0f}% above a peer's."
        )
    if close:
        parts.append(
            f"It was above a peer's by less than {(_NOISE - 1) * 100:.0f}%, within "
            "the spread of this shared two-core machine, on these rows:\n\n"
            + "\n".join(f"- {line}" for line in close)
        )
    verdict = "\n\n".join(parts)
    return f"""## Analysis

{verdict}

{_EXPLANATIONS}"""


def render(
    tables: list[peers.Table],
    *,
    quick: bool,
    seconds: float,
    load: str,
    shared: bool,
    long_loops: dict | None = None,
) -> str:
    """The page, as markdown. `long_loops` holds the results of
    `benchmarks.checkpointed` (section 5), measured apart: its long cases take
    minutes."""
    sections = {
        "step": _step_section,
        "first_call": _first_call_section,
        "ensemble": _ensemble_section,
        "train": _train_section,
    }
    body = "\n".join(sections[t.name](t) for t in tables)
    if long_loops is not None:
        body += "\n" + checkpointed.section(long_loops) + "\n"
    mode = " (`--quick`: few rounds, not a measurement)" if quick else ""
    who = (
        "other jobs were running at the same time"
        if shared
        else "the benchmark alone keeps it near 1"
    )
    return f"""# Benchmarks

How eqstate compares with [brainstate](https://github.com/chaobrain/brainstate),
[Flax NNX](https://flax.readthedocs.io) and [Equinox](https://docs.kidger.site/equinox/)
on four workloads, with plain JAX as the floor of every table, then the memory of
reverse-mode autodiff through long loops (section 5). This page is generated by
`benchmarks/report.py` from the workloads in `benchmarks/peers.py` and the results
of `benchmarks/checkpointed.py`; regenerate it with the commands below. The workloads
below keep their states in handles read by the step; the training step in the style
the Equinox how-to teaches (the model passed in) is measured by
`python -m benchmarks.train_step`, on the same machine as its floor, and [Benchmarks
on a TPU](benchmarks-tpu.md) gives it with its peak memory and the per-call cost on
an accelerator.

```bash
pip install -e '.[dev,bench]'
python -m benchmarks.checkpointed      # section 5 (long; stores its results)
python -m benchmarks.report            # full run: rewrites docs/benchmarks.md
python -m benchmarks.report --quick    # smoke test: prints the page
```

## Method

- Machine: {machine()}.
- Load average (1, 5, 15 minutes) at the start and at the end of the run: {load}
  ({who}){mode}. The run took {seconds / 60:.1f} minutes.
- All workloads run in one process, the systems side by side. In every round each
  system is timed in turn (the order rotates from round to round), after warm-up
  calls; a sample is the mean time of several consecutive calls, the last one blocked
  on.
- **median** is over rounds and **min-max** is the spread over rounds. **x floor** is
  the median over rounds of the system's time divided by the floor's time *in the same
  round*, so that drift in the machine's speed cancels out; it can therefore differ
  from the ratio of the medians.
- Before it is timed, every system is checked against the floor: the same state
  values after one step (1), a separate random draw per ensemble member (3), the same
  first three losses (4).
- A peer that is not installed is reported as missing, one that cannot run a workload
  as unsupported, with the reason; nothing is substituted for it.

{_versions_section()}

{body}
{_analysis(tables)}"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="few rounds and small sizes (CI smoke)"
    )
    parser.add_argument(
        "--output",
        help=f"where to write the page, '-' for stdout (default: {_PAGE}, or stdout "
        "with --quick)",
    )
    args = parser.parse_args()
    output = args.output or ("-" if args.quick else str(_PAGE))
    loads = [os.getloadavg()]
    start_load = "{:.1f}, {:.1f}, {:.1f}".format(*loads[0])
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        tables = peers.run_all(quick=args.quick)
        if args.quick:
            long_loops = checkpointed.run(checkpointed.QUICK_SIZES, quick=True)
        else:
            long_loops = checkpointed.load()
    seconds = time.perf_counter() - start
    loads.append(os.getloadavg())
    end_load = "{:.1f}, {:.1f}, {:.1f}".format(*loads[1])
    # The benchmark itself keeps about one core busy; more means other jobs ran too.
    shared = max(load[1] for load in loads) > 1.5
    page = render(
        tables,
        quick=args.quick,
        seconds=seconds,
        load=f"{start_load} / {end_load}",
        shared=shared,
        long_loops=long_loops,
    )
    if output == "-":
        print(page)
    else:
        pathlib.Path(output).write_text(page)
        print(f"wrote {output} ({seconds / 60:.1f} minutes)")
    jax.effects_barrier()


if __name__ == "__main__":
    main()
