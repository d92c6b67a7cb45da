"""The weight a loss needs: which weighting of the micro-batches' gradients the
whole batch's gradient is.

``MultiSteps``' ``weight`` is the count the loss divides by: tokens for a token
mean, rows for a mean of per-row means (EasyLM's loss), all positions (rows
times length) for a mean over every position; a loss divided by a constant, or
not at all, sums its micro-batches' gradients as they are
(``grad_reduction="window_mean"``). The audit computes each of these counts per
micro-batch (from ``loss_fn``'s weight and the batch's shapes) and tries each
weighting on the first batch: the whole batch's gradient must be ``sum_i c_i
g_i`` with ``c_i = n_i / sum_j n_j`` (a mean over the count ``n``) or ``c_i =
1`` (a sum). Where none fits, the least-squares combination says how the whole
batch weighs them ("none of the usual counts"); where no combination is near,
the loss couples the micro-batches (F10).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from optax_accum._audit._compare import flat, norm
from optax_accum._audit._runs import BatchGradient, GradFn
from optax_accum._audit._terms import _counts as counts_text
from optax_accum._audit._terms import _fit as fit_columns
from optax_accum._audit._terms import _proportion

#: The weightings tried, in this order after the declared one: ``loss_fn``'s
#: weight, the rows, the positions (each normalised: a mean over that count),
#: and 1 per micro-batch unnormalised (a sum).
KINDS = ("weight", "rows", "positions", "sum")
#: Two weightings are the same where their coefficients differ by less than this.
SAME = 1e-6


def _most_common(values: list[int]) -> int | None:
  return collections.Counter(values).most_common(1)[0][0] if values else None


def rows_of(batch: Any) -> int | None:
  """The micro-batch's rows: its leaves' leading axis (the most common length)."""
  return _most_common([np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)])


def positions_of(batch: Any) -> int | None:
  """Its positions, rows times length: the product of the first two axes of
  its leaves with two or more (the most common product)."""
  shapes = [np.shape(x) for x in jax.tree.leaves(batch) if np.ndim(x) >= 2]
  return _most_common([s[0] * s[1] for s in shapes])


@dataclasses.dataclass(frozen=True)
class Counts:
  """Each micro-batch's candidate counts, for one batch.

  Attributes:
    weight: ``loss_fn``'s weight.
    rows: The rows (leading axis); ``None`` where a leaf has none.
    positions: Rows times length; ``None`` where no leaf has two axes.
  """

  weight: np.ndarray
  rows: np.ndarray | None
  positions: np.ndarray | None

  @classmethod
  def of(cls, micro: Sequence[Any], weights: Sequence[float]) -> Counts:
    rows = [rows_of(m) for m in micro]
    positions = [positions_of(m) for m in micro]
    return cls(
      np.asarray(weights, np.float64),
      None if None in rows else np.asarray(rows, np.float64),
      None if None in positions else np.asarray(positions, np.float64),
    )

  def coefficients(self, kind: str) -> np.ndarray | None:
    """The whole batch's coefficients under ``kind``; ``None`` where it has no
    such count (or none of it)."""
    if kind == "sum":
      return np.ones(len(self.weight))
    n = getattr(self, kind)
    if n is None or not n.sum() > 0:
      return None
    return n / n.sum()

  def name(self) -> str:
    """What ``loss_fn``'s weight counts, for people: ``"rows"`` or
    ``"positions"`` where it is that, ``"sequences"`` where it is a whole
    number no larger than the rows (at most one a row), ``"tokens"`` where it
    is a larger whole number, else ``"weight"``."""
    w = self.weight
    for kind in ("rows", "positions"):
      n = getattr(self, kind)
      if n is not None and np.array_equal(w, n):
        return kind
    if not np.array_equal(w, np.round(w)) or np.all(w == 1):
      return "weight"
    if self.rows is not None and np.all(w <= self.rows):
      return "sequences"
    return "tokens"


#: Each count's words: its plural, one micro-batch's, and the variable a fix names.
NOUNS = {
  "tokens": ("token count", "n_tokens"),
  "sequences": ("sequence count", "n_sequences"),
  "rows": ("row count", "n_rows"),
  "positions": ("position count (rows x length)", "n_positions"),
  "weight": ("count the loss divides by", "n"),
}


@dataclasses.dataclass(frozen=True)
class Weighting:
  """How the whole batch weighs its micro-batches' gradients, on the first batch.

  Attributes:
    kind: ``"weight"`` (``loss_fn``'s weight), ``"rows"``, ``"positions"``,
      ``"sum"`` (1 each, not normalised), ``"fitted"`` (a combination in
      proportion to none of these: fitted per batch) or ``"coupled"`` (no
      combination: the loss couples the micro-batches).
    declared: The weighting the setup is told: ``"weight"``, or ``"sum"`` for
      ``grad_reduction="window_mean"``.
    counts: The first batch's counts.
    coefficients: The whole batch's coefficient of each micro-batch's gradient
      (fitted by least squares for ``"fitted"`` and ``"coupled"``).
    residual: The relative distance of ``sum_i c_i g_i`` from the whole batch's
      gradient.
    also: Other counts that give the same weighting here (``"positions"``
      beside ``"rows"`` where every row has the same length).
  """

  kind: str
  declared: str
  counts: Counts
  coefficients: np.ndarray
  residual: float
  also: tuple[str, ...] = ()

  @property
  def as_declared(self) -> bool:
    """Whether the weighting the setup is told is the whole batch's."""
    return self.kind == self.declared or self.declared in self.also

  @property
  def weight_name(self) -> str:
    """What ``loss_fn``'s weight counts (see :meth:`Counts.name`)."""
    return self.counts.name()

  def count_name(self) -> str:
    """The count the whole batch weighs by, for people."""
    if self.kind == "weight":
      name = self.weight_name
      return "its weight" if name == "weight" else name
    if self.kind in ("rows", "positions"):
      return " or ".join([self.kind, *(a for a in self.also if a != "weight")])
    return self.kind

  def describe(self) -> str:
    """How the whole batch weighs the micro-batches, in words with numbers."""
    c = counts_text(self.coefficients)
    if self.kind == "sum":
      return "sums the micro-batches' gradients as they are (1 each)"
    if self.kind == "fitted":
      return (
        f"weighs the micro-batches {short_vector(self.coefficients)}, in proportion to "
        f"{counts_text(proportion(self.coefficients))}: none of their "
        f"{self._usual()}"
      )
    if self.kind == "weight" and self.weight_name == "weight":
      return f"weighs the micro-batches by loss_fn's weight, {c}"
    n = getattr(self.counts, self.kind)
    return f"weighs the micro-batches by their {self.count_name()} {counts_text(n)}"

  def _usual(self) -> str:
    """The counts tried, with their values."""
    c = self.counts
    named = {self.weight_name: c.weight}  # Each name once: the weight's first.
    for kind in ("rows", "positions"):
      named.setdefault(kind, getattr(c, kind))
    seen = [f"{name} {counts_text(n)}" for name, n in named.items() if n is not None]
    return ", ".join(seen) + " or 1 each"

  def fix(self) -> str:
    """The weight and ``grad_reduction`` that reproduce the whole batch."""
    if self.kind == "sum":
      return (
        "the loss is a sum (divided by a constant or not at all): sum the "
        "micro-batches' gradients as they are, optax_accum.MultiSteps(opt, k, "
        "grad_reduction='window_mean') (its weight only counts items), or divide "
        "the loss by its own item count and pass that count as its weight"
      )
    mean = "optax_accum.MultiSteps(opt, k)"  # grad_reduction='mean', the default
    if self.kind == "fitted":
      return (
        "return as loss_fn's weight the number of items the loss is a mean over "
        f"(here in proportion to {counts_text(proportion(self.coefficients))}), "
        f"and pass it to {mean}.update(grads, state, params, weight=n) "
        "(grad_reduction='mean', the default); a loss divided by a constant "
        "takes grad_reduction='window_mean'"
      )
    name = self.weight_name if self.kind == "weight" else self.kind
    count, var = NOUNS[name]
    also = ""
    if self.kind == "rows" and "positions" in self.also:
      also = " (or its position count: the same weighting in these micro-batches)"
    return (
      f"pass each micro-batch's {count}{also} as its weight, the count its loss "
      f"divides by: {mean}.update(grads, state, params, weight={var}) "
      "(grad_reduction='mean', the default)"
    )

  def batch_gradient(self, grad_fn: GradFn) -> BatchGradient:
    """The whole batch's gradient as this weighting of its micro-batches'
    (the same maths summed in another order: how far the two runs end apart
    is rounding), and the total of ``loss_fn``'s weight."""
    kind = self.kind if self.kind != "coupled" else "weight"

    def gradient(params: Any, batch: Any, micro: Sequence[Any]) -> tuple[Any, float]:
      pairs = [grad_fn(params, m) for m in micro]
      grads, weights = [g for g, _ in pairs], [float(w) for _, w in pairs]
      c: np.ndarray | None
      if kind == "fitted":
        whole, _ = grad_fn(params, batch)
        c, _ = fit_columns(np.stack([flat(g) for g in grads]), flat(whole))
      else:
        c = Counts.of(micro, weights).coefficients(kind)
      if c is None:  # No such count in this batch: its own gradient.
        return grad_fn(params, batch)[0], sum(weights)
      return combined(grads, c, params), sum(weights)

    return gradient


def shares(
  weighting: Weighting | None,
) -> tuple[list[float] | None, tuple[list[float], str] | None]:
  """The whole batch's coefficients (``()`` where it is no combination; ``None``
  with loss terms: the tokens' shares), and the setup's where they differ."""
  if weighting is None:
    return None, None
  right = [] if weighting.kind == "coupled" else list(weighting.coefficients)
  if weighting.as_declared:
    return right, None
  told = weighting.counts.coefficients(weighting.declared)
  if told is None:
    return right, None
  by = (
    "grad_reduction='window_mean'"
    if weighting.declared == "sum"
    else "loss_fn's weight"
  )
  return right, (list(told), by)


def report_fields(weighting: Weighting | None) -> dict[str, Any]:
  """The report's ``weight_name``, ``whole_batch_weighting`` and
  ``whole_batch_weights``."""
  if weighting is None:
    return {}
  coupled = weighting.kind == "coupled"
  return {
    "weight_name": weighting.weight_name,
    "whole_batch_weighting": weighting.kind
    if weighting.kind in ("sum", "fitted", "coupled")
    else weighting.count_name(),
    "whole_batch_weights": None
    if coupled
    else [float(c) for c in weighting.coefficients],
    "as_declared": weighting.as_declared,
    "whole_batch_weighs": "" if coupled else weighting.describe(),
  }


def proportion(c: np.ndarray) -> np.ndarray:
  """``c`` scaled to the smallest whole numbers it is in proportion to (up to
  64 times its smallest positive entry), or to that entry 1."""
  base = _proportion(c)
  for m in range(1, 65):
    if np.allclose(m * base, np.round(m * base), rtol=0, atol=1e-3 * m):
      return m * base
  return base


def short_vector(c: Sequence[float] | np.ndarray) -> str:
  """Coefficients to three significant digits, in brackets."""
  return "[" + ", ".join(f"{x:.3g}" for x in c) + "]"


def combined(grads: Sequence[Any], c: Sequence[float] | np.ndarray, like: Any) -> Any:
  """``sum_i c_i g_i`` in float32, cast back to each leaf's dtype."""
  total = jax.tree.map(
    lambda *g: sum(
      float(ci) * x.astype(jnp.float32) for ci, x in zip(c, g, strict=True)
    ),
    *grads,
  )
  return jax.tree.map(lambda s, p: s.astype(jnp.result_type(p)), total, like)


def find(
  whole: Any, micro_grads: Sequence[Any], counts: Counts, declared: str, tol: float
) -> Weighting:
  """Which weighting of ``micro_grads`` ``whole`` is: the declared one first,
  then :data:`KINDS` in order; else the nearest combination."""
  target = flat(whole)
  g = np.stack([flat(x) for x in micro_grads])
  scale = max(norm(target), 1e-30)
  fits: dict[str, np.ndarray] = {}
  for kind in (declared, *(k for k in KINDS if k != declared)):
    c = counts.coefficients(kind)
    if c is not None and norm(target - c @ g) / scale <= tol:
      fits[kind] = c
  if fits:
    kind, c = next(iter(fits.items()))
    also = tuple(
      other
      for other in KINDS
      if other != kind
      and (o := counts.coefficients(other)) is not None
      and np.allclose(o, c, rtol=0, atol=SAME)
    )
    return Weighting(kind, declared, counts, c, norm(target - c @ g) / scale, also)
  c, residual = fit_columns(g, target)
  kind = "fitted" if residual <= tol else "coupled"
  return Weighting(kind, declared, counts, c, residual)
