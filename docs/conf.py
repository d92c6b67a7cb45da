"""Sphinx configuration: ``make docs`` builds the site into docs/_build/html."""

import pathlib
import pkgutil
import sys

from sphinx.pycode import ModuleAnalyzer

import optax_accum

project = "optax_accum"
release = version = optax_accum.__version__
copyright = "the optax_accum authors"

extensions = [
  "myst_nb",  # MyST markdown pages and notebooks (includes myst_parser)
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",  # Google-style Args:/Returns:/Examples: sections
  "mathtext_svg",  # docs/mathtext_svg.py: formulas drawn at build time
]
sys.path.insert(0, str(pathlib.Path(__file__).parent))  # for mathtext_svg

# Formulas become inline SVG when the site is built (matplotlib's mathtext),
# not MathJax from a CDN when a page is read: the site works offline.
html_math_renderer = "mathtext_svg"

# The notebooks are rendered from their committed outputs, never executed here:
# the test suite executes them, and `make notebooks` refreshes the outputs.
nb_execution_mode = "off"
# Links such as [text](multi_steps.md#what-happens-when) need heading anchors.
myst_heading_anchors = 3
exclude_patterns = ["_build", "jupyter_execute", ".ipynb_checkpoints"]

autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "furo"
html_title = "optax_accum"


def _comment_of_reexported_constant(app, what, name, obj, options, lines):
  """A constant ``optax_accum`` re-exports keeps the ``#:`` comment written
  above it in its own module (autodoc would show ``str``'s docstring)."""
  del app, obj, options
  if what != "data":
    return
  attr = name.rpartition(".")[2]
  for module in pkgutil.walk_packages(optax_accum.__path__, "optax_accum."):
    comment = ModuleAnalyzer.for_module(module.name).find_attr_docs().get(("", attr))
    if comment:
      lines[:] = list(comment)
      return


def setup(app):
  app.connect("autodoc-process-docstring", _comment_of_reexported_constant)
