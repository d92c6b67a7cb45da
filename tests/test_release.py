"""The release as users install it: the sdist and the wheel, each built from
this tree by setuptools and installed by pip (`--python`) into a fresh virtual
environment without pip or setuptools of its own, import and run, with the
package's data files and its version.

The fresh environment finds jax, optax and numpy through a ``.pth`` line naming
the test's own site-packages (pip, offline, cannot fetch them): a path line
only, so that directory's own ``.pth`` files, which hold this checkout's
editable install, are not run and the import comes from the new environment.
"""

import pathlib
import site
import subprocess
import sys
import tarfile
import venv

import pytest

import optax_accum

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Run in the fresh environment: where the package comes from, and one window.
CHECK = """
import pathlib, sys, jax.numpy as jnp, optax, optax_accum
here = pathlib.Path(optax_accum.__file__).resolve()
assert here.is_relative_to(pathlib.Path(sys.prefix).resolve()), here
assert (here.parent / "py.typed").is_file()
assert list((here.parent / "data").glob("*.txt")), "the demo's text is missing"
from importlib import metadata
files = [str(f) for f in metadata.files("optax_accum")]
assert any(f.endswith("LICENSE") for f in files), files
opt = optax_accum.MultiSteps(optax.sgd(1.0), every_k_schedule=2)
state = opt.init(jnp.zeros(()))
_, state = opt.update(jnp.array(1.0), state, weight=1)
u, state = opt.update(jnp.array(3.0), state, weight=3)
print(optax_accum.__version__, float(u))
"""


def _run(*command, cwd=ROOT) -> str:
  done = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _build(kind: str, out: pathlib.Path) -> pathlib.Path:
  code = "import sys; from setuptools import build_meta as b; "
  code += f"print(b.build_{kind}(sys.argv[1]))"
  return out / _run(sys.executable, "-c", code, str(out)).strip().splitlines()[-1]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
  out = tmp_path_factory.mktemp("dist")
  return {kind: _build(kind, out) for kind in ("sdist", "wheel")}


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_the_built_package_installs_and_runs_in_a_fresh_venv(built, kind, tmp_path):
  env = tmp_path / "venv"
  venv.EnvBuilder(with_pip=False).create(env)  # No setuptools of its own either.
  python = env / "bin" / "python"
  where = _run(python, "-c", "import site; print(site.getsitepackages()[0])")
  deps = "\n".join(site.getsitepackages())  # jax, optax, numpy, setuptools
  (pathlib.Path(where.strip()) / "deps.pth").write_text(deps + "\n")
  pip = [sys.executable, "-m", "pip", "--python", python, "install", "--quiet"]
  _run(*pip, "--no-deps", "--no-index", "--no-build-isolation", built[kind])
  ran = _run(python, "-c", CHECK, cwd=tmp_path)
  assert ran.split() == [optax_accum.__version__, "-2.5"]


def test_the_sdist_ships_the_license_and_no_half_test_suite(built):
  with tarfile.open(built["sdist"]) as sdist:
    names = [name.split("/", 1)[1] for name in sdist.getnames() if "/" in name]
  assert "LICENSE" in names and "optax_accum/py.typed" in names
  assert not [name for name in names if name.startswith("tests/")]


def test_the_version_is_the_changelog_s_latest_release():
  changelog = (ROOT / "CHANGELOG.md").read_text()
  released = [line for line in changelog.splitlines() if line.startswith("## [0")]
  assert released[0].startswith(f"## [{optax_accum.__version__}] - ")
