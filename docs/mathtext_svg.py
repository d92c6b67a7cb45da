"""Formulas drawn at build time, so the site shows them offline.

Sphinx's default HTML math renderer loads MathJax from a CDN when a page is
viewed: offline, a reader sees raw TeX. This renderer draws each formula once,
while the site is built, with matplotlib's mathtext (the TeX subset it knows:
fractions, sums, sub- and superscripts, Greek letters, spacing commands) and
writes it into the page as an inline ``<svg>``:

- its glyphs are outlines filled with ``currentColor``, so a formula takes the
  colour of the text around it, in the light and the dark theme alike;
- its size is in ``em`` and an inline formula sits on the text's baseline, so
  it scales with the page's font;
- the TeX source stays in the page as the image's accessible name.

A formula mathtext cannot parse is a Sphinx warning (an error under ``-W``)
that names the formula, and the page shows its source instead.

Use: ``extensions = ["mathtext_svg"]`` with ``docs/`` on ``sys.path`` and
``html_math_renderer = "mathtext_svg"`` in ``conf.py``.
"""

from __future__ import annotations

import functools
import html
import io
import re
from typing import Any

from docutils import nodes
from sphinx.errors import ExtensionError
from sphinx.util import logging
from sphinx.util.math import get_node_equation_number

logger = logging.getLogger(__name__)

# Formulas are drawn at this size, in points, then written in em: the page's
# font sets their final size.
_SIZE = 12.0
_DISPLAY_SCALE = 1.15  # Display formulas a little larger than inline ones.
_RC = {
  "mathtext.fontset": "cm",  # Computer Modern, the look of TeX.
  "svg.fonttype": "path",  # Glyphs as outlines: no font needed by the reader.
  "svg.hashsalt": "optax_accum",  # The same ids on every build.
}
_INK = "#000000"  # Drawn in black, then written as currentColor.
_PREFIX = "mathtext-svg-id-"  # Stands for the formula's own id prefix.


@functools.cache
def render(tex: str, scale: float = 1.0) -> str:
  """The inline ``<svg>`` element for the TeX formula ``tex`` (no ``$``).

  Raises:
    ValueError: mathtext cannot parse ``tex``.
  """
  import matplotlib
  from matplotlib import figure, font_manager, mathtext

  expression = f"${tex.strip()}$"
  with matplotlib.rc_context(_RC):
    font = font_manager.FontProperties(size=_SIZE)
    # The parser rounds its box up to whole dots: at 8 dots a point, the
    # box is the ink's to an eighth of a point.
    box = mathtext.MathTextParser("path").parse(expression, dpi=72 * 8, prop=font)
    width, height, depth = (float(x) / 8 for x in box[:3])  # Points.
    fig = figure.Figure(figsize=(width / 72, height / 72))  # Points to inches.
    fig.text(0, depth / height, expression, fontproperties=font, color=_INK)
    out = io.StringIO()
    fig.savefig(out, format="svg", transparent=True, metadata={"Date": None})
  svg = out.getvalue()
  svg = svg[svg.index("<svg") :]  # No XML declaration or DOCTYPE inside HTML.
  svg = re.sub(r"\s*<metadata>.*?</metadata>", "", svg, flags=re.DOTALL)
  svg = re.sub(r"<!--.*?-->", "", svg, flags=re.DOTALL)  # The TeX, as a comment.
  # Its stylesheet (`*{stroke-linejoin...}`) would apply to the whole page.
  svg = re.sub(r"\s*<defs>\s*<style.*?</style>\s*</defs>", "", svg, flags=re.DOTALL)
  svg = svg.replace(_INK, "currentColor")
  # Two formulas on a page must not share ids (each defines its own glyphs):
  # _PREFIX becomes a page-unique prefix where the formula is written.
  svg = re.sub(r'\bid="([^"]+)"', rf'id="{_PREFIX}\1"', svg)
  svg = re.sub(r'href="#([^"]+)"', rf'href="#{_PREFIX}\1"', svg)
  svg = re.sub(r"url\(#([^)]+)\)", rf"url(#{_PREFIX}\1)", svg)
  em = _SIZE / scale
  label = html.escape(tex.strip(), quote=True)
  size = (
    f'width="{width / em:.3f}em" height="{height / em:.3f}em" '
    f'style="vertical-align: {-depth / em:.3f}em" fill="currentColor" role="img" '
    f'aria-label="{label}"'
  )
  svg = re.sub(r'width="[^"]*"\s+height="[^"]*"', lambda _: size, svg, count=1)
  return re.sub(r"\n\s*", "", svg)  # One line: no stray spaces around the image.


def _svg_or_source(self: Any, node: nodes.Element, tex: str, scale: float) -> str:
  """The formula's ``<svg>``, its ids prefixed with the page's formula count."""
  try:
    svg = render(tex, scale)
  except ValueError as error:
    why = " ".join(str(error).split())
    logger.warning("mathtext cannot draw the formula %r: %s", tex, why, location=node)
    return f'<code class="math">{html.escape(tex)}</code>'
  self.mathtext_svg_count = getattr(self, "mathtext_svg_count", 0) + 1
  return svg.replace(_PREFIX, f"math{self.mathtext_svg_count}-")


def visit_math(self: Any, node: nodes.math) -> None:
  tex = node.astext()
  self.body.append(f'<span class="math">{_svg_or_source(self, node, tex, 1.0)}</span>')
  raise nodes.SkipNode


def visit_displaymath(self: Any, node: nodes.math_block) -> None:
  # A blank line separates equations in one directive; mathtext draws one line.
  equations = [part for part in re.split(r"\n\s*\n", node.astext()) if part.strip()]
  self.body.append(self.starttag(node, "div", CLASS="math", style="text-align: center"))
  if node.get("number"):
    number = get_node_equation_number(self, node)
    self.body.append(f'<span class="eqno">({number})')
    self.add_permalink_ref(node, "Link to this equation")
    self.body.append("</span>")
  for tex in equations:
    self.body.append(f"<p>{_svg_or_source(self, node, tex, _DISPLAY_SCALE)}</p>")
  self.body.append("</div>\n")
  raise nodes.SkipNode


def setup(app: Any) -> dict[str, Any]:
  try:
    import matplotlib  # noqa: F401
  except ImportError as error:
    raise ExtensionError(
      "mathtext_svg draws the formulas with matplotlib: "
      "pip install -e '.[docs,notebooks]'"
    ) from error
  app.add_html_math_renderer(
    "mathtext_svg", (visit_math, None), (visit_displaymath, None)
  )
  return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
