"""`examples/multi_process_train.py`, killed after a checkpoint and started again,
ends where an uninterrupted run ends, and where a single process with the same
global batches ends."""

import io
import pathlib
import re
import subprocess
import sys
import threading
import time

import pytest
from eqstate._launch import local_processes, wait_all


_EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "multi_process_train.py"
_TIMEOUT = 240.0


class _Watch(io.StringIO):
    """An output stream that flags when a line matching `pattern` arrives."""

    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = re.compile(pattern)
        self.seen = threading.Event()

    def write(self, text: str) -> int:
        if self.pattern.search(text):
            self.seen.set()
        return super().write(text)


def _final_loss(output: str) -> float:
    match = re.search(r"final loss (\S+)", output)
    assert match is not None, f"no final loss in the output:\n{output[-4000:]}"
    return float(match.group(1))


def _train(directory: pathlib.Path) -> str:
    out = io.StringIO()
    command = [sys.executable, str(_EXAMPLE), "--quick", "--checkpoint-dir"]
    with local_processes([*command, str(directory)], 2, cpu_devices=2, out=out) as ps:
        code = wait_all(ps, _TIMEOUT)
    assert code == 0, out.getvalue()[-4000:]
    return out.getvalue()


def test_resumed_run_ends_like_an_uninterrupted_one_and_one_process(tmp_path):
    uninterrupted = _final_loss(_train(tmp_path / "uninterrupted"))

    # Killed (SIGKILL, every process) as soon as the first checkpoint is on disk.
    crashed = tmp_path / "crashed"
    watch = _Watch(r"\[0\] checkpoint 40 saved")
    command = [sys.executable, str(_EXAMPLE), "--quick", "--checkpoint-dir"]
    with local_processes([*command, str(crashed)], 2, cpu_devices=2, out=watch) as ps:
        deadline = time.monotonic() + _TIMEOUT
        while not watch.seen.wait(0.05):
            assert time.monotonic() < deadline, watch.getvalue()[-4000:]
            if all(p.poll() is not None for p in ps):
                pytest.fail(f"the run ended early:\n{watch.getvalue()[-4000:]}")
    assert "final loss" not in watch.getvalue()  # it was cut short

    resumed = _train(crashed)
    # The kill lands after checkpoint 40; a later one may be out too (a slow kill).
    found = re.search(r"resumed from checkpoint (\d+)\n", resumed)
    assert found and int(found[1]) % 40 == 0 and int(found[1]) >= 40, resumed[-4000:]
    assert _final_loss(resumed) == pytest.approx(uninterrupted, rel=1e-6)

    single = subprocess.run(
        [*command, str(tmp_path / "single"), "--single-process"],
        capture_output=True,
        text=True,
        timeout=_TIMEOUT,
    )
    assert single.returncode == 0, single.stdout + single.stderr
    assert _final_loss(single.stdout) == pytest.approx(uninterrupted, rel=1e-4)
