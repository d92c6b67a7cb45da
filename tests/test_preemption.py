"""A run killed with SIGKILL and restarted ends as if it had never been killed.

`examples/resumable_training.py` runs as a user would run it: once without
interruption, and once killed mid-run (after a checkpoint taken in the middle
of an accumulation window, and a few micro-batches past it) and restarted in
the same workdir. The final params must be bit-identical, and every
micro-batch must have been added to the optimizer state exactly once, by the
`seen` counts that live in the checkpoint and by the log.
"""

import importlib.util
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

import optax_accum

EXAMPLE = pathlib.Path(__file__).parents[1] / "examples" / "resumable_training.py"
TOTAL, K, EVERY = 24, 4, 5  # Checkpoints at 5, 10, 15: all mid-window.
TIMEOUT = 120


def start(workdir: pathlib.Path, *flags: str) -> subprocess.Popen:
  workdir.mkdir(exist_ok=True)
  command = [sys.executable, str(EXAMPLE), "--workdir", str(workdir)]
  command += ["--out", str(workdir / "final.npz"), "--micro-batches", str(TOTAL)]
  command += ["--k", str(K), "--checkpoint-every", str(EVERY), *flags]
  with open(workdir / "output.txt", "ab") as output:
    return subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)


def output(workdir: pathlib.Path) -> str:
  return (workdir / "output.txt").read_text(errors="replace")


def finish(process: subprocess.Popen, workdir: pathlib.Path) -> None:
  try:
    process.wait(timeout=TIMEOUT)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
    raise AssertionError(f"timed out:\n{output(workdir)}") from None
  assert process.returncode == 0, output(workdir)


def attempts(log: str) -> list[dict]:
  """The log split into attempts: where each started, what it added and saved."""
  runs: list[dict] = []
  for line in log[: log.rfind("\n") + 1].splitlines():  # Whole lines only.
    event = line.split(": ", 1)[1]
    if match := re.fullmatch(r"(started|resumed) at micro-batch (\d+).*", event):
      runs.append({"start": int(match[2]), "added": [], "saved": [], "done": False})
    elif match := re.fullmatch(r"micro-batch (\d+) added.*", event):
      runs[-1]["added"].append(int(match[1]))
    elif match := re.fullmatch(r"checkpoint at micro-batch (\d+)", event):
      runs[-1]["saved"].append(int(match[1]))
    elif event.startswith("done"):
      runs[-1]["done"] = True
  return runs


def kill_after_checkpoint(process: subprocess.Popen, workdir: pathlib.Path) -> None:
  """SIGKILLs the run once it has saved and added 2 more micro-batches."""
  log, deadline = workdir / "train.log", time.monotonic() + TIMEOUT
  while time.monotonic() < deadline and process.poll() is None:
    runs = attempts(log.read_text()) if log.exists() else []
    if runs and runs[0]["saved"] and runs[0]["added"][-1] >= runs[0]["saved"][0] + 1:
      process.send_signal(signal.SIGKILL)
      break
    time.sleep(0.01)
  else:
    process.kill()
    process.wait()
    raise AssertionError(f"no checkpoint before the deadline:\n{output(workdir)}")
  assert process.wait(timeout=TIMEOUT) == -signal.SIGKILL, output(workdir)


@pytest.mark.slow
def test_sigkill_mid_window_and_restart_is_bit_identical(tmp_path):
  reference_dir, run_dir = tmp_path / "reference", tmp_path / "preempted"
  processes = [start(reference_dir), start(run_dir, "--sleep", "0.5")]
  try:
    kill_after_checkpoint(processes[1], run_dir)
    assert not (run_dir / "final.npz").exists()
    shutil.copytree(run_dir / "checkpoints", tmp_path / "control")
    processes.append(start(run_dir))  # The restart: same command, no sleep.
    finish(processes[0], reference_dir)
    finish(processes[2], run_dir)
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()

  reference = np.load(reference_dir / "final.npz")
  resumed = np.load(run_dir / "final.npz")
  assert sorted(resumed) == ["params/embed", "params/head", "seen"]
  for name in ("params/embed", "params/head"):
    np.testing.assert_array_equal(resumed[name], reference[name])
  np.testing.assert_array_equal(reference["seen"], np.ones(TOTAL, np.int32))
  np.testing.assert_array_equal(resumed["seen"], np.ones(TOTAL, np.int32))

  log = (run_dir / "train.log").read_text()
  killed, restarted = attempts(log)  # Exactly two attempts.
  assert not killed["done"] and restarted["done"], log
  assert killed["start"] == 0 and killed["added"] == list(range(len(killed["added"])))
  resume_at = restarted["start"]
  assert resume_at == killed["saved"][-1], log  # The last checkpoint before the kill.
  assert 0 < resume_at < killed["added"][-1], log  # Some micro-batches redone...
  assert resume_at % K != 0, log  # ... from the middle of a window.
  assert restarted["added"] == list(range(resume_at, TOTAL)), log
  counted = [i for i in killed["added"] if i < resume_at] + restarted["added"]
  assert counted == list(range(TOTAL)), log  # ... but each counted once.

  check_controls(tmp_path / "control", resume_at, reference)


def check_controls(checkpoints: pathlib.Path, resume_at: int, reference) -> None:
  """The checks above catch a resume that drops the optimizer state or the position.

  In this process, from a copy of the checkpoint the restart resumed from.
  """
  spec = importlib.util.spec_from_file_location("resumable_training", EXAMPLE)
  assert spec is not None and spec.loader is not None
  example = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(example)
  opt = example.make_optimizer(TOTAL, K)
  step = optax_accum.make_train_step(example.loss_fn, opt)
  manager = ocp.CheckpointManager(checkpoints.resolve())
  target = ocp.args.StandardRestore(example.fresh_state(opt, TOTAL))

  def resume(start: int, keep_opt_state: bool) -> tuple[dict, np.ndarray]:
    state = manager.restore(resume_at, args=target)
    params, seen = state["params"], np.array(state["seen"])
    opt_state = state["opt_state"] if keep_opt_state else opt.init(params)
    assert int(opt_state.mini_step) == (resume_at % K if keep_opt_state else 0)
    for i in range(start, TOTAL):
      batch = example.micro_batch(i)
      params, opt_state, _ = step(params, opt_state, batch, end_window=i == TOTAL - 1)
      seen[i] += 1
    return jax.tree.map(np.asarray, params), seen

  params, seen = resume(resume_at, keep_opt_state=True)  # What the restart does.
  for name, value in params.items():
    np.testing.assert_array_equal(value, reference[f"params/{name}"])
  np.testing.assert_array_equal(seen, np.ones(TOTAL, np.int32))

  # Window and moments lost: `seen` cannot tell (it was restored), the params can.
  params, seen = resume(resume_at, keep_opt_state=False)
  np.testing.assert_array_equal(seen, np.ones(TOTAL, np.int32))
  diff = max(np.abs(v - reference[f"params/{n}"]).max() for n, v in params.items())
  assert diff > 1e-4

  _, seen = resume(0, keep_opt_state=True)  # Data position ignored: replayed.
  assert seen[:resume_at].tolist() == [2] * resume_at
  manager.close()
