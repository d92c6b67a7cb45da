"""The scripts in examples/ run as a user runs them and print what they claim.

(`examples/resumable_training.py` is run, killed and restarted by
`test_preemption.py`.)
"""

import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np

EXAMPLES = pathlib.Path(__file__).parents[1] / "examples"
LM_FINETUNE = EXAMPLES / "lm_finetune.py"


def test_lm_finetune_trains_and_matches_whole_batch_training():
  """A short run (3 updates, 1 block): its loss per window, and the end-of-run
  check against the same run on whole batches passes, leaving out only the
  attention key bias, whose gradient is rounding noise."""
  run = subprocess.run(
    [sys.executable, str(LM_FINETUNE), "--windows", "3", "--layers", "1"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert run.returncode == 0, run.stdout + run.stderr
  out = run.stdout
  losses = [float(x) for x in re.findall(r"^window +\d+  loss (\S+)", out, re.M)]
  assert len(losses) == 3 and all(np.isfinite(losses)), out
  assert re.search(r"^window +2 .* lr 3\.00e-03 ", out, re.M), out  # Warmup's peak.
  loss_diff = float(re.search(r"largest loss difference +(\S+)", out)[1])
  params_diff = float(re.search(r"largest params difference on a leaf +(\S+)", out)[1])
  assert loss_diff <= 1e-5 and params_diff <= 1e-5, out
  assert "not compared: ['blocks/0/attention/key/bias']" in out, out
  assert out.rstrip().splitlines()[-2] == "  same training: yes", out


def _load(path: pathlib.Path):
  spec = importlib.util.spec_from_file_location(path.stem, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_lm_finetune_check_fails_when_a_leaf_with_a_gradient_differs(capsys):
  """The example's own check would catch a wrong run; a leaf whose gradient is
  noise may differ without failing it."""
  example = _load(LM_FINETUNE)
  reference = {
    "w": np.ones((3, 2), np.float32),
    "key_bias": np.full(2, 0.1, np.float32),
  }
  grad_norms = {"w": np.float32(0.5), "key_bias": np.float32(1e-9)}
  noisy_bias = {**reference, "key_bias": -reference["key_bias"]}
  assert example.check(noisy_bias, [2.0], reference, [2.0], grad_norms)
  wrong_w = {**reference, "w": reference["w"] * 1.001}
  assert not example.check(wrong_w, [2.0], reference, [2.0], grad_norms)
  assert not example.check(reference, [2.0], reference, [2.001], grad_norms)
  assert capsys.readouterr().out.count("same training: NO") == 2


def test_coupled_losses_train_as_the_whole_batch_does(capsys):
  """Issue 50's recipes: after AdamW updates, the two-pass window's params are
  the whole-batch run's (float32 rounding), the per-micro-batch loss's not."""
  results = _load(EXAMPLES / "coupled_losses.py").main(["--windows", "2", "--k", "4"])
  for name, r in results.items():
    assert r["two-pass window"] <= 1e-5, (name, r)
    assert r["per micro-batch"] > 100 * r["two-pass window"], (name, r)
  assert "two-pass window" in capsys.readouterr().out
