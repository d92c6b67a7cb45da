"""Test-wide JAX settings: 8 simulated CPU devices and strict numerics.

The suite runs on CPU unless ``OPTAX_ACCUM_TEST_PLATFORM`` names other
platforms, as ``JAX_PLATFORMS`` would: ``cuda,cpu`` or ``tpu,cpu`` (``make
test-accelerator``) runs it on the accelerator, with the 8 simulated CPU
devices beside it for the tests that ask for CPU devices; the tests that need
8 devices of the default backend skip. There, float32 matmuls run at
``"highest"`` precision (on recent NVIDIA GPUs the default is TF32, about 3e-4
apart from the whole batch; ``tests/test_accelerator.py`` measures it), and
each process allocates GPU memory as it goes, so that two xdist workers share
one GPU. An outer ``JAX_DEFAULT_MATMUL_PRECISION`` or
``XLA_PYTHON_CLIENT_PREALLOCATE`` is kept.

Also reports progress per test file: a line as each file finishes (under
pytest-xdist too) with its outcomes and the CPU seconds its tests took, and
``--cpu-durations=N`` lists the N tests that took the most CPU time (user +
system, this process and the subprocesses it waited for: notebooks, workers).
Unlike ``--durations`` (wall time), these hold still on a busy machine.
"""

from __future__ import annotations

import collections
import fcntl
import os
import pickle
import resource
import shutil
import tempfile
import time

# Must happen before JAX initialises its backends.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
  ).strip()
if os.environ.get("OPTAX_ACCUM_TEST_PLATFORM", "").strip():
  os.environ["JAX_PLATFORMS"] = os.environ["OPTAX_ACCUM_TEST_PLATFORM"].strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Fast compiles (below, with the other JAX settings).
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
if os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in {"1", "true"}:
  for _flag, _value in (
    ("use_fusion_emitters", "false"),
    ("parallel_codegen_split_count", "1"),
  ):
    if f"--xla_cpu_{_flag}" not in os.environ["XLA_FLAGS"]:
      os.environ["XLA_FLAGS"] += f" --xla_cpu_{_flag}={_value}"
# An accelerator first: through the environment, for workers and subprocesses too.
if os.environ["JAX_PLATFORMS"].split(",")[0] != "cpu":
  os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# A GPU's scatter-adds (an embedding's gradient) add in a varying order unless
# told not to; the bit-identity tests (a resumed run against an uninterrupted
# one) need the same order every run.
if os.environ["JAX_PLATFORMS"].split(",")[0] in ("cuda", "rocm", "gpu") and (
  "--xla_gpu_deterministic_ops" not in os.environ["XLA_FLAGS"]
):
  os.environ["XLA_FLAGS"] += " --xla_gpu_deterministic_ops=true"

import jax
import pytest

#: Whether the tests run on an accelerator: the first platform named is not the CPU.
ACCELERATOR = os.environ["JAX_PLATFORMS"].split(",")[0] != "cpu"
if ACCELERATOR:
  jax.config.update(
    "jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"]
  )

# Strict dtype promotion is not set globally: optax's own schedules and
# optax.MultiSteps mix Python floats with int32 counts. Our code is pinned to it
# by `test_multi_steps.py::test_update_needs_no_implicit_promotion`.
jax.config.update("jax_numpy_rank_promotion", "raise")
# One JAX compilation cache per run, new and empty, shared through the
# environment by the xdist workers (started after this runs) and every
# subprocess (notebook kernels, example scripts, the multi-process workers).
# Tests build the same programs again and again (each new step or jit of the
# same computation compiles anew); with the cache XLA compiles each once, and
# compiling is most of the suite's CPU time. The programs are the same either
# way. An outer JAX_COMPILATION_CACHE_DIR is kept (and not removed);
# JAX_ENABLE_COMPILATION_CACHE=false turns the cache off.
_OWN_CACHE = None
_CACHE_OFF = os.environ.get("JAX_ENABLE_COMPILATION_CACHE", "").lower() in {
  "0",
  "false",
}
if not _CACHE_OFF and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _OWN_CACHE = tempfile.mkdtemp(prefix="optax-accum-tests-jax-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _OWN_CACHE
  # Every program, however small or quick to compile.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
if not _CACHE_OFF:  # jax is imported already: set its flags as the env does.
  jax.config.update(
    "jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"]
  )
  for _flag, _type in (("min_compile_time_secs", float), ("min_entry_size_bytes", int)):
    if f"JAX_PERSISTENT_CACHE_{_flag.upper()}" in os.environ:
      jax.config.update(
        f"jax_persistent_cache_{_flag}",
        _type(os.environ[f"JAX_PERSISTENT_CACHE_{_flag.upper()}"]),
      )
# XLA's CPU backend compiles fast: without LLVM's optimisation passes (XLA's
# `xla_backend_optimization_level=0`, which halves most compiles), with XLA's
# elemental emitters rather than its MLIR fusion emitters
# (`--xla_cpu_use_fusion_emitters=false`, set above: a small model's compile
# halves again) and with the machine code in one LLVM module, not split for
# parallel codegen (`--xla_cpu_parallel_codegen_split_count=1`: a small MLP's
# MultiSteps step compiles in 163 ms of CPU rather than 289 ms). The HLO passes
# still run: the programs, their collectives, XLA's cost and memory figures are
# those of a default build (`tests/data/program_costs.json` matches in every
# setting); only the machine code is slower and float results may differ in
# the last bits. So the tests that compare with output recorded from a default
# build or pin two programs' bits to each other (marked `full_optimization`:
# the README's printed output, release checkpoints, a window's end in two
# programs or one) run with LLVM's passes. XLA reads XLA_FLAGS once per
# process, so they keep the two XLA flags; their outputs match either way.
# Through the environment the xdist workers and every subprocess get all
# three; JAX_DISABLE_MOST_OPTIMIZATIONS=0 turns all three off.
_FAST_COMPILE = os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"].lower() in {"1", "true"}
jax.config.update("jax_disable_most_optimizations", _FAST_COMPILE)
_compiling_fast = [_FAST_COMPILE]  # This process's setting now.


def _compile_fast(fast: bool) -> None:
  """Switches the setting for this process and the subprocesses it starts."""
  if _compiling_fast[0] == fast:
    return
  _compiling_fast[0] = fast
  # The setting is not part of jit's in-memory cache key: without clearing, a
  # function compiled before would run its program of the other setting. (The
  # persistent cache's key holds it.)
  jax.clear_caches()
  jax.config.update("jax_disable_most_optimizations", fast)
  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1" if fast else "0"


@pytest.fixture(autouse=True)
def _optimization_level(request):
  """Full optimisation for a test marked `full_optimization` (see above)."""
  if _FAST_COMPILE:
    _compile_fast(request.node.get_closest_marker("full_optimization") is None)


# -- CPU time per test (measured where the test runs: the xdist worker) ----------


def _cpu_seconds() -> float:
  """User + system time of this process and of its waited-for children."""
  own = resource.getrusage(resource.RUSAGE_SELF)
  children = resource.getrusage(resource.RUSAGE_CHILDREN)
  return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


class _CpuClock:
  """Adds each phase's CPU seconds to its report (a plugin rather than conftest
  hooks, so that the package's doctests are timed too)."""

  def __init__(self):
    self.mark: dict[str, float] = {}

  def pytest_runtest_logstart(self, nodeid, location):
    del location
    self.mark[nodeid] = _cpu_seconds()

  @pytest.hookimpl(hookwrapper=True)
  def pytest_runtest_makereport(self, item, call):
    del call
    outcome = yield
    now = _cpu_seconds()
    spent = now - self.mark.get(item.nodeid, now)
    self.mark[item.nodeid] = now
    # user_properties travel with the report from an xdist worker.
    outcome.get_result().user_properties.append(("cpu_s", round(spent, 3)))


# -- progress per file and the CPU summary (where the reports arrive) -----------


def pytest_addoption(parser):
  parser.addoption(
    "--cpu-durations",
    type=int,
    default=0,
    metavar="N",
    help="show the N tests that took the most CPU time (0: none)",
  )


class _FileProgress:
  """Counts each file's tests as their reports arrive; a line when one is done."""

  def __init__(self, config):
    self.config = config
    self.expected: collections.Counter[str] | None = None
    self.done: collections.Counter[str] = collections.Counter()
    self.outcomes: dict[str, collections.Counter[str]] = collections.defaultdict(
      collections.Counter
    )
    self.cpu: collections.Counter[str] = collections.Counter()
    self.start = time.monotonic()
    self.per_test: collections.Counter[str] = collections.Counter()
    self.total_cpu = 0.0

  @staticmethod
  def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]

  def set_expected(self, nodeids) -> None:
    if self.expected is None:  # Every xdist worker collects the same ids.
      self.expected = collections.Counter(self._file(n) for n in nodeids)

  @pytest.hookimpl(optionalhook=True)
  def pytest_xdist_node_collection_finished(self, node, ids):
    del node
    self.set_expected(ids)

  def pytest_collection_finish(self, session):
    if session.items:  # Not the xdist controller, which collects nothing.
      self.set_expected(item.nodeid for item in session.items)

  def pytest_runtest_logreport(self, report):
    name = self._file(report.nodeid)
    spent = dict(report.user_properties).get("cpu_s", 0.0)
    self.cpu[name] += spent
    self.per_test[report.nodeid] += spent
    self.total_cpu += spent
    if report.when == "call" or report.outcome != "passed":
      self.outcomes[name][report.outcome] += 1
    if report.when != "teardown":
      return
    self.done[name] += 1
    if self.expected is not None and self.done[name] == self.expected[name]:
      self._report_file(name)

  def _report_file(self, name: str) -> None:
    reporter = self.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or self.config.get_verbosity() > 0:
      return  # Verbose output names every test already.
    counts = ", ".join(f"{n} {o}" for o, n in sorted(self.outcomes[name].items()))
    minutes, seconds = divmod(int(time.monotonic() - self.start), 60)
    if reporter._tw.width_of_current_line:  # After a run of progress dots.
      reporter.write("\n")
    reporter.write_line(
      f"[{minutes:2d}:{seconds:02d}] {name}: {counts}, {self.cpu[name]:.0f} s CPU"
    )

  def pytest_terminal_summary(self, terminalreporter):
    count = self.config.getoption("cpu_durations")
    if not count or not self.per_test:
      return
    terminalreporter.write_sep("=", f"most CPU time: {count} tests, {count} files")
    for nodeid, spent in self.per_test.most_common(count):
      terminalreporter.write_line(f"{spent:8.1f} s  {nodeid}")
    terminalreporter.write_line("")
    for name, spent in self.cpu.most_common(count):
      terminalreporter.write_line(f"{spent:8.1f} s  {name}")
    terminalreporter.write_line(
      f"{self.total_cpu:8.1f} s  in all {len(self.cpu)} files (user + system)"
    )


def pytest_report_header(config):
  del config
  import test_reference

  examples = test_reference.EXAMPLES
  default = test_reference.DEFAULT_EXAMPLES
  size = "the CI size" if examples == default else f"CI runs {default}"
  cache = "off" if _CACHE_OFF else os.environ.get("JAX_COMPILATION_CACHE_DIR", "off")
  return [
    f"float64 reference: {examples} examples ({size}; "
    "OPTAX_ACCUM_REFERENCE_EXAMPLES=2000 for more)",
    f"JAX compilation cache: {cache}",
    f"JAX platforms: {os.environ['JAX_PLATFORMS']} (OPTAX_ACCUM_TEST_PLATFORM), "
    f"matmul precision: {jax.config.jax_default_matmul_precision or 'default'}",
  ]


def pytest_unconfigure(config):
  del config
  if _OWN_CACHE is not None:
    shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def pytest_configure(config):
  config.pluginmanager.register(_CpuClock(), "cpu-clock")
  if not hasattr(config, "workerinput"):  # The controller, or a run without xdist.
    config.pluginmanager.register(_FileProgress(config), "file-progress")


def pytest_collection_modifyitems(config, items):
  """Tests marked `slow` first: xdist hands tests out one by one in this
  order, so the workers finish together, on short tests."""
  del config
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def run_once(tmp_path_factory):
  """``run_once(name, compute)``: ``compute(folder)`` once per test run.

  xdist sends tests that share a fixture to both workers; with this, the first
  worker to ask runs ``compute`` (in a folder of the run's temporary directory)
  and keeps its picklable result, and the other reads it (waiting if it must).
  """

  def run(name, compute):
    if "PYTEST_XDIST_WORKER" not in os.environ:
      return compute(tmp_path_factory.mktemp(name))
    shared = tmp_path_factory.getbasetemp().parent / name  # The run's, not a worker's.
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)  # Released when the file closes.
      done = shared / "result.pickle"
      if not done.exists():
        (shared / "out").mkdir()
        done.write_bytes(pickle.dumps(compute(shared / "out")))
      return pickle.loads(done.read_bytes())

  return run
