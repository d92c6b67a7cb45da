"""Two real processes (2 CPU devices each, gloo collectives) match one process."""

import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
import toy_lm

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 300


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize(  # Two processes each: the default mesh's recipe in CI.
  "recipe",
  [
    "auto",
    "axis_name",
    "explicit",
  ],
)
def test_two_processes_match_the_single_process_run(tmp_path, recipe):
  out = tmp_path / "params.npz"
  env = dict(
    os.environ,
    # Two devices a process (the last count given wins), the suite's other
    # flags (tests/conftest.py) kept.
    XLA_FLAGS=os.environ["XLA_FLAGS"] + " --xla_force_host_platform_device_count=2",
    JAX_PLATFORMS="cpu",
  )
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(port), str(i), str(out), recipe],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(2)
  ]
  logs = []
  try:
    for proc in procs:
      logs.append(proc.communicate(timeout=TIMEOUT_S)[0])
  finally:
    for proc in procs:  # On failure or timeout: nothing is left running.
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
  assert logs[0].count("updated True") == 5, logs[0]

  batches = [toy_lm.make_batch(seed=100 + i, batch=32) for i in range(5)]
  params0 = toy_lm.init_params(seed=0)
  reference, _, _ = toy_lm.whole_batch_run(
    params0, batches, toy_lm.adamw_with_schedule()
  )
  saved = np.load(out)
  multihost = jax.tree_util.tree_map_with_path(
    lambda path, _: saved[jax.tree_util.keystr(path)], reference
  )
  assert toy_lm.max_rel_diff(params0, reference) > 1e-2  # The run moved params.
  assert toy_lm.max_rel_diff(multihost, reference) <= 1e-5
