"""The benchmark script runs end to end and writes its three result files."""

import json

from benchmarks import accumulation


def test_benchmark_smoke(tmp_path, capsys):
  options = ["--models", "mlp-64x2-b4", "--ks", "1", "4", "--repeats", "2"]
  runs = accumulation.main([*options, "--out", str(tmp_path), "--machine", "smoke"])
  assert [run["k"] for run in runs] == [1, 4]
  for suffix in ("json", "md", "png"):
    assert (tmp_path / f"smoke.{suffix}").stat().st_size > 0
  saved = json.loads((tmp_path / "smoke.json").read_text())
  k4 = saved["runs"][1]
  assert {"stream non-final / limit", "stream temp bytes / optax"} <= set(k4["targets"])
  for entry in ("limit", "optax", "stream_avg", "scan", "whole"):
    assert k4["results"][entry]["ms"] > 0
  assert "| mlp-64x2-b4 | 4 |" in capsys.readouterr().out
