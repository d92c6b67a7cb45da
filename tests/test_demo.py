"""The README's first command: its table and plot must say what they claim."""

import contextlib
import io

import numpy as np
import pytest

from optax_accum import demo

STEPS = 12


@pytest.fixture(scope="session")
def demo_run(run_once):
  """One short demo run, shared (by both xdist workers too): its printed
  table, results and output folder."""

  def run(out):
    table = io.StringIO()
    with contextlib.redirect_stdout(table):
      results = demo.main(["--steps", str(STEPS), "--k", "4", "--out", str(out)])
    return table.getvalue(), results, out

  return run_once("demo", run)


@pytest.mark.slow  # The demo run: first, so the other test finds it done.
def test_demo_table_shows_the_fix(demo_run):
  table, results, out = demo_run
  assert "optax_accum" in table and "optax.MultiSteps" in table
  ours, theirs = results["optax_accum"], results["optax.MultiSteps"]
  assert ours["grad_error"] <= 1e-5 and ours["params_diff"] <= 1e-4, results
  assert theirs["grad_error"] > 1e-2, results
  assert theirs["params_diff"] > 100 * ours["params_diff"], results
  assert results["whole batch"]["params_diff"] == 0.0
  assert (out / "demo.png").stat().st_size > 0


def test_demo_plots_each_runs_distance_from_the_whole_batch_per_update(demo_run):
  """The plot's log-scale panel: after every update, optax.MultiSteps is orders
  of magnitude further from the whole-batch run than optax_accum."""
  _, results, _ = demo_run
  ours = np.asarray(results["optax_accum"]["distances"])
  theirs = np.asarray(results["optax.MultiSteps"]["distances"])
  assert ours.shape == theirs.shape == (STEPS,)
  assert np.all(np.asarray(results["whole batch"]["distances"]) == 0.0)
  # The warmup's first learning rate is 0: every run is still at the start.
  assert ours[0] == theirs[0] == 0.0
  assert np.all(ours[1:] <= 1e-5), ours
  assert np.all(theirs[1:] > 1000 * ours[1:]), (theirs, ours)
  assert ours[-1] == results["optax_accum"]["params_diff"]  # The table's number.


@pytest.mark.parametrize("argv", [["--k", "5"], ["--k", "0"], ["--steps", "1"]])
def test_demo_rejects_bad_options(argv):
  with pytest.raises(SystemExit):
    demo.main(argv)


def test_corpus_is_shipped_with_the_package():
  text = demo.corpus()
  assert text.startswith("Four score and seven years ago") and len(set(text)) > 30
