"""The README's first command: its table must say what it claims."""

import pytest

from optax_accum import demo


def test_demo_table_shows_the_fix(capsys):
  results = demo.main(["--steps", "6", "--k", "4"])
  table = capsys.readouterr().out
  assert "optax_accum.MultiSteps" in table and "optax.MultiSteps" in table
  grad_err, params_diff = results["optax_accum.MultiSteps"]
  assert grad_err <= 1e-5 and params_diff <= 1e-4, results
  optax_grad_err, optax_params_diff = results["optax.MultiSteps"]
  assert optax_grad_err > 1e-2 and optax_params_diff > 100 * params_diff, results
  assert results["whole batch"] == (0.0, 0.0)


@pytest.mark.parametrize("argv", [["--k", "5"], ["--k", "0"], ["--steps", "1"]])
def test_demo_rejects_bad_options(argv):
  with pytest.raises(SystemExit):
    demo.main(argv)
