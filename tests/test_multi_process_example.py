"""`examples/multi_process_train.py`, killed after a checkpoint and started again,
ends where an uninterrupted run ends, and where a single process with the same
global batches ends."""

import pathlib
import re
import subprocess
import sys

import pytest

from .helpers import launch, launcher


_EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "multi_process_train.py"
_TIMEOUT = 240.0


def _final_loss(output: str) -> float:
    # The number alone: with `PYTHONUNBUFFERED` set, `print` writes a line's newline
    # apart, and another thread's log line can land right after the number.
    match = re.search(r"final loss ([-+]?[0-9.]+(?:e[-+]?[0-9]+)?|nan)", output)
    assert match is not None, f"no final loss in the output:\n{output[-4000:]}"
    return float(match.group(1))


def _program(directory: pathlib.Path) -> list[str]:
    return [str(_EXAMPLE), "--quick", "--checkpoint-dir", str(directory)]


def _train(directory: pathlib.Path) -> str:
    code, output = launch(_program(directory), 2, _TIMEOUT)
    assert code == 0, output[-4000:]
    return output


def _crash_after_the_first_checkpoint(directory: pathlib.Path) -> str:
    """Runs the example until process 0 reports its first checkpoint, then stops the
    launcher, which kills every process (SIGKILL); the output."""
    running = subprocess.Popen(
        [*launcher(2, _TIMEOUT), *_program(directory)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    assert running.stdout is not None
    lines = []
    try:
        # Ends at the launcher's timeout at the latest, which closes the output.
        for line in running.stdout:
            lines.append(line)
            if line.startswith("[0] checkpoint 40 saved"):
                running.terminate()
                break
        else:
            pytest.fail(f"the run ended early:\n{''.join(lines)[-4000:]}")
        lines.append(running.communicate(timeout=60)[0])
    finally:
        running.kill()
        running.wait()
    return "".join(lines)


def test_resumed_run_ends_like_an_uninterrupted_one_and_one_process(tmp_path):
    uninterrupted = _final_loss(_train(tmp_path / "uninterrupted"))

    crashed = tmp_path / "crashed"
    assert "final loss" not in _crash_after_the_first_checkpoint(crashed)

    resumed = _train(crashed)
    # The kill lands after checkpoint 40; a later one may be out too (a slow kill).
    found = re.search(r"resumed from checkpoint (\d+)", resumed)
    assert found and int(found[1]) % 40 == 0 and int(found[1]) >= 40, resumed[-4000:]
    assert _final_loss(resumed) == pytest.approx(uninterrupted, rel=1e-6)

    single = subprocess.run(
        [sys.executable, *_program(tmp_path / "single"), "--single-process"],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )
    assert single.returncode == 0, single.stdout + single.stderr
    assert _final_loss(single.stdout) == pytest.approx(uninterrupted, rel=1e-4)
