"""The README's first command: its table must say what it claims."""

import pytest

from optax_accum import demo


def test_demo_table_shows_the_fix(capsys, tmp_path):
  results = demo.main(["--steps", "12", "--k", "4", "--out", str(tmp_path)])
  table = capsys.readouterr().out
  assert "optax_accum" in table and "optax.MultiSteps" in table
  ours, theirs = results["optax_accum"], results["optax.MultiSteps"]
  assert ours["grad_error"] <= 1e-5 and ours["params_diff"] <= 1e-4, results
  assert theirs["grad_error"] > 1e-2, results
  assert theirs["params_diff"] > 100 * ours["params_diff"], results
  assert results["whole batch"]["params_diff"] == 0.0
  assert (tmp_path / "demo.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--k", "5"], ["--k", "0"], ["--steps", "1"]])
def test_demo_rejects_bad_options(argv):
  with pytest.raises(SystemExit):
    demo.main(argv)


def test_corpus_is_shipped_with_the_package():
  text = demo.corpus()
  assert text.startswith("Four score and seven years ago") and len(set(text)) > 30
