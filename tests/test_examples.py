"""The examples run end to end, as a user would run them: in a fresh interpreter."""

import pathlib
import re
import subprocess
import sys

import pytest


_EXAMPLES = pathlib.Path(__file__).parent.parent / "examples"


def _loss(label: str, text: str) -> float:
    match = re.search(rf"^  {re.escape(label)} +(\d+\.\d+)$", text, re.MULTILINE)
    assert match is not None, f"no line {label!r} in the output:\n{text}"
    return float(match.group(1))


def test_train_ensemble_quick_reports_losses_and_writes_checkpoint_and_plot(
    tmp_path,
):
    script = _EXAMPLES / "train_ensemble.py"
    result = subprocess.run(
        [sys.executable, str(script), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout

    members = [_loss(f"member {i:2d}", out) for i in range(16)]
    average, ensemble = _loss("average member", out), _loss("ensemble (mean)", out)
    # The squared error is convex, so the mean prediction can only do better.
    assert abs(average - sum(members) / 16) < 1e-3 and ensemble <= average
    # The progress bar, printed from inside the compiled loop, reached its end.
    assert re.search(r"training: (\d+)/\1 \[#+\]", result.stderr)
    assert "predictions are identical: True" in out

    checkpoint = (tmp_path / "ensemble.eqstate").read_bytes()
    assert checkpoint.startswith(b"\x93EQSTATE")
    png = (tmp_path / "ensemble_predictions.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize(
    "script, expected",
    [
        ("mlp_batchnorm.py", r"checkpoint round trip: 8 arrays, bit for bit"),
        ("ensemble_member.py", r"member 3 alone vs its lane: max difference"),
        ("rnn_scan.py", r"batch of 3: outputs \(20, 3, 8\)"),
    ],
)
def test_equinox_examples_run_quick_and_pass_their_checks(script, expected):
    # Each asserts its own claims (bit-exact checkpoint, member equal to its lane,
    # outputs per batch size): a failed check is a non-zero exit.
    result = subprocess.run(
        [sys.executable, str(_EXAMPLES / script), "--quick"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(expected, result.stdout), result.stdout
