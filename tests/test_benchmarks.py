"""The benchmark script runs end to end and writes its three result files."""

import json

import jax
import numpy as np
import pytest

from benchmarks import accumulation


def test_benchmark_smoke(tmp_path):
  options = ["--models", "mlp-64x2-b4", "--ks", "1", "4", "--repeats", "2"]
  options += ["--leaf-counts", "10", "--machine", "smoke", "--out", str(tmp_path)]
  try:
    runs = accumulation.main(options)
  except SystemExit as e:  # A bound beaten on a noisy machine: still reported.
    assert "beat its lower bound" in str(e)
    runs = json.loads((tmp_path / "smoke.json").read_text())["runs"]
  assert [run["k"] for run in runs] == [1, 4]
  for suffix in ("json", "md", "png"):
    assert (tmp_path / f"smoke.{suffix}").stat().st_size > 0
  saved = json.loads((tmp_path / "smoke.json").read_text())
  k4 = saved["runs"][1]
  assert {
    "stream / floor",
    "stream / hand-written stream",
    "stream temp bytes / optax (+1 KiB)",
  } <= set(k4["targets"])
  timed = ("limit", "limit_flat", "optax", "stream", "stream_in_graph", "scan", "whole")
  timed += ("stream_handwritten", "optimizer_flat", "stream_flat_optimizer")
  for entry in timed:
    assert k4["results"][entry]["ms"] > 0
  assert k4["results"]["limit"]["source"] in accumulation.LIMITS
  assert [row["leaves"] for row in saved["host_overhead"]] == [10]
  assert "| mlp-64x2-b4 | 4 |" in (tmp_path / "smoke.md").read_text()


def test_a_variant_faster_than_its_bound_is_reported():
  """Round by round: faster beyond the slack in three rounds of four; one
  quiet round (a best round far ahead) alone does not count."""
  names = ("limit", "stream", "stream_in_graph", "stream_handwritten", "optax")
  names += ("scan", "scan_limit", "scan_handwritten")
  results = {name: {"rounds": [10.0] * 4} for name in names}
  assert accumulation.bounds_violated(results) == []
  results["stream"]["rounds"] = [5.0, 10.0, 10.0, 10.0]  # One quiet round.
  assert accumulation.bounds_violated(results) == []
  results["scan"]["rounds"] = [9.0, 9.0, 9.0, 12.0]  # Ahead in three rounds.
  assert accumulation.bounds_violated(results) == [
    "scan / scan_limit < 0.97 in 3 rounds of 4 (median 0.900)"
  ]
  results["scan_handwritten"]["rounds"] = [9.5] * 4  # The hand-written window too.
  assert len(accumulation.bounds_violated(results)) == 2
  results["stream_handwritten"]["rounds"] = [9.5] * 4  # And the hand-written stream.
  assert len(accumulation.bounds_violated(results)) == 3
  # A window's floor (per micro-step) that the streams beat is wrong too.
  results["floor"] = {"rounds": [12.0] * 4}
  violated = accumulation.bounds_violated(results)
  assert "stream / floor < 0.97 in 4 rounds of 4 (median 0.833)" in violated
  assert len(violated) == 6  # The three streams against the floor.
  results["floor"]["rounds"] = [10.0] * 4  # Only the hand-written stream (9.5).
  assert len(accumulation.bounds_violated(results)) == 4


def test_the_floor_is_its_fastest_candidate_by_median_with_its_rounds():
  """The separate loops' sum or a floor loop, whole: not the least of them
  round by round, which noise biases low."""
  rounds = {
    "limit": [1.0, 1.0, 1.0],
    "optimizer": [4.0, 4.0, 4.0],  # Separate loops: 1 + 4/4 = 2 a micro-step.
    "floor_loop": [1.5, 3.0, 3.0],  # Median 3: one quiet round.
    "floor_loop_flat": [1.9, 1.8, 2.4],  # Median 1.9: the floor.
    "scan_limit": [1.0, 1.0, 1.0],
  }
  t = accumulation.round_times({v: {"rounds": x} for v, x in rounds.items()}, 4)
  np.testing.assert_array_equal(t["floor"], [1.9, 1.8, 2.4])
  assert accumulation.floor_of(t, 4)[0] == "floor_loop_flat"
  t["floor_loop_flat"] = t["floor_loop_flat"] + 1.0
  assert accumulation.floor_of(t, 4)[0] == "separate loops"


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_data_parallel_benchmark_counts_one_reduction_per_window(tmp_path):
  """On the 8 test devices: the bytes reduced per window, from the HLO."""
  from benchmarks import data_parallel

  # Two leaves and a row per device: the bytes reduced per window do not
  # depend on depth or rows, and fewer of them compile and run faster.
  options = ["--ks", "1", "4", "--repeats", "1", "--windows", "1", "--width", "64"]
  options += ["--depth", "2", "--rows", "8"]
  rows = data_parallel.main([*options, "--machine", "smoke", "--out", str(tmp_path)])
  ratio = {
    (row["recipe"], row["k"]): row["bytes_per_window"] / row["params_bytes"]
    for row in rows
  }
  for recipe in data_parallel.RECIPES:
    # Once per window: under jit on an Explicit mesh, with or without
    # axis_name, and in scan mode with axis_name in your shard_map.
    with_axis = "axis_name" in recipe and (recipe.startswith("jit") or "scan" in recipe)
    once = with_axis or (recipe.startswith("jit") and "Auto" not in recipe)
    assert round(ratio[recipe, 4], 1) == (1.0 if once else 4.0), (recipe, ratio)
    assert round(ratio[recipe, 1], 1) == 1.0, (recipe, ratio)
  assert (tmp_path / "smoke-data-parallel.md").stat().st_size > 0


def test_lm_benchmark_smoke(tmp_path):
  """The LM benchmark on a tiny LM: every variant timed per window, the ratios,
  tokens per second and both targets written; its results files exist."""
  from benchmarks import lm

  options = ["--model", "lm-1x8-b2", "--ks", "2", "--repeats", "1"]
  options += ["--windows", "1", "--machine", "smoke", "--out", str(tmp_path)]
  try:
    rows = lm.main(options)
  except SystemExit as e:  # A bound beaten on a noisy machine: still reported.
    assert "beat its lower bound" in str(e)
    rows = json.loads((tmp_path / "smoke-lm.json").read_text())["rows"]
  (row,) = rows
  assert row["k"] == 2
  for variant in ("floor", "stream", "optax", "scan", "scan_handwritten", "whole"):
    assert row["windows_ms"][variant]["ms"] > 0
  assert row["stream tokens/s"] > 0 and row["scan tokens/s"] > 0
  assert {
    "stream / floor",
    "scan / hand-written scan window",
  } <= set(row["targets"])
  assert row["targets"]["stream / floor"][1] == 1.05
  assert (tmp_path / "smoke-lm.md").stat().st_size > 0


def test_accelerator_smoke(tmp_path):
  """The accelerator benchmark on the tiniest LM: every variant timed,
  the targets' ratios and rates written."""
  from benchmarks import accelerator

  options = ["--models", "lm-1x8-b2", "--ks", "2", "--repeats", "1"]
  (row,) = accelerator.main([*options, "--windows", "1", "--out", str(tmp_path)])
  assert row["k"] == 2
  assert all(ms > 0 for ms in row["window_ms"].values())
  assert set(row["ratios"]) >= {f"{a} / {b}" for a, b, _ in accelerator.TARGETS}
  assert row["rates"]["scan"]["TFLOP/s"] > 0
  (written,) = tmp_path.glob("*-accelerator.json")
  assert json.loads(written.read_text())["rows"][0]["k"] == 2


def test_compile_benchmark_smoke():
  """``benchmarks/compile.py``'s four paths and their references run on a
  tiny model, and its table has a cell per path."""
  from benchmarks import compile as compile_bench

  model = accumulation.many_leaves(6, 8, 2)
  row = {"model": "tiny", "leaves": 6}
  for path in compile_bench.PATHS:
    row[path] = getattr(compile_bench, path)(model)
    assert row[path]["seconds"] > 0 and row[path]["reference_seconds"] > 0
  assert row["update_in_jit"]["instructions"] > 0
  table = compile_bench.markdown([row])
  assert table.splitlines()[2].count("x**") == len(compile_bench.PATHS)


def test_noise_scale_benchmark_smoke(tmp_path):
  """``benchmarks/noise_scale.py`` times its four variants and reads the
  programs' costs: on, a squared norm more than off."""
  from benchmarks import noise_scale

  rows = noise_scale.main(
    [
      "--model",
      "lm-1x8-b2",
      "--ks",
      "2",
      "--rounds",
      "1",
      "--windows",
      "1",
      "--out",
      str(tmp_path),
    ]
  )
  assert [r["mode"] for r in rows] == ["stream", "scan"]
  for r in rows:
    assert r["off_ms"] > 0 and r["on_ms"] > 0
    assert r["flops"][1] > r["flops"][0] > 0
  assert (tmp_path / "cpu-x86_64-noise-scale.md").exists()


def test_batch_ramp_smoke(tmp_path):
  """``benchmarks/batch_ramp.py --smoke``: held-out text from the standard
  library, the tuned peak, every run per seed with its paired differences,
  the branches' critical batch, and the results files."""
  from benchmarks import batch_ramp

  text = batch_ramp.stdlib_text()
  assert text["info"]["bytes"]["train"] > 5 * text["info"]["bytes"]["eval"] > 0
  table = batch_ramp.main(["--smoke", "--out", str(tmp_path), "--docs-plot", ""])
  assert set(table) == set(batch_ramp.run_names([1, 2]))
  assert table["small"]["updates"] == [32, 32]
  assert table["large"]["updates"] == [16, 16]
  assert table["switch"]["updates"] == [24, 24]
  zero = table["small"]["minus_small"]
  assert zero["mean"] == zero["low"] == zero["high"] == 0.0
  for run in table.values():
    d = run["minus_best_fixed"]
    assert d["low"] <= d["mean"] <= d["high"]
  (path,) = tmp_path.glob("*-batch-ramp.json")
  saved = json.loads(path.read_text())
  assert saved["meta"]["data"]["python"]
  (cut,) = saved["branches"]
  assert cut["critical_k"] in (1, 2)
  for suffix in ("md", "png"):
    assert path.with_suffix(f".{suffix}").stat().st_size > 0
