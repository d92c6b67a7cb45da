"""How ``audit`` explains a difference: gradient fits and per-leaf comparisons."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

#: A leaf whose whole-batch gradient changes by more than this fraction when
#: the same sum is taken in another order has a gradient at rounding level.
ROUNDING_LEVEL = 1e-2
#: How far past the rounding difference of two exact whole-batch runs a leaf
#: may end before it counts as different.
ROUNDING_MARGIN = 10.0
#: Coefficients below this fraction of the largest count as a dropped
#: micro-batch.
DROPPED = 1e-3


def flat(tree: Any) -> np.ndarray:
  """Every leaf of ``tree``, in float64, as one vector."""
  leaves = [np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(tree)]
  return np.concatenate(leaves) if leaves else np.zeros(0)


def norm(x: np.ndarray) -> float:
  return float(np.linalg.norm(x))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
  return norm(a - b) / max(norm(b), 1e-30)


@dataclasses.dataclass
class GradientFit:
  """What the first window's applied gradient is, in terms of the batch's.

  Attributes:
    error: Relative error against the whole-batch gradient.
    kind: ``"whole"`` (it matches), ``"none"`` (nothing applied), ``"declared"``
      (the micro-batches weighed as the setup is told, by ``loss_fn``'s weight
      or 1 each for ``grad_reduction="window_mean"``, where the whole batch
      weighs them otherwise), ``"last"``
      (a multiple of the last micro-batch's gradient), ``"dropped"`` (a
      combination that leaves micro-batches out), ``"uniform"`` (a multiple of
      the mean of micro-batch gradients: F1), ``"scaled"`` (a multiple of the
      whole-batch gradient), or ``"other"``.
    scale: The multiple, for the kinds that have one (1.0 otherwise).
    coefficients: The weight the applied gradient gives each micro-batch's
      gradient (least squares), or ``None`` when it is no combination of them.
    what: What it is, in words (empty when it matches).
  """

  error: float
  kind: str
  scale: float
  coefficients: list[float] | None
  what: str = ""

  @property
  def describe(self) -> str:
    """One line for the report: how far off, and what it is."""
    off = f"{self.error:.1e} from the whole batch's"
    return f"{off}: {self.what}" if self.what else off


def _scale_name(s: float, k: int, share: tuple[float, float]) -> str:
  n_last, total = share
  candidates = [
    ("unscaled", 1.0),
    (f"scaled by 1/k = 1/{k}", 1 / k),
    (
      f"scaled by its share of the window's tokens, {n_last:.0f}/{total:.0f}",
      n_last / total,
    ),
    (f"times k = {k}", float(k)),
  ]
  for name, value in candidates:
    if abs(s - value) <= 1e-3 * abs(value):
      return name
  return f"scaled by {s:.3g}"


def fit_gradient(
  applied: Any,
  whole: Any,
  micro_grads: Sequence[Any],
  tokens: Sequence[float],
  tol: float,
  right: Sequence[float] | None = None,
  declared: tuple[Sequence[float], str] | None = None,
) -> GradientFit:
  """Fits ``applied`` with each candidate explanation; the first that fits wins.

  Each candidate is a direction ``d`` and fits when ``applied = c * d`` to
  within ``tol`` for the best ``c``, so scaled forms of a bug (the last
  micro-batch's gradient divided by ``k``, or by its share of the tokens) are
  recognised as that bug. ``right`` is the whole batch's coefficient of each
  micro-batch's gradient (``None``: its share of ``tokens``; no combination
  for a loss that couples them: ``()``), ``declared`` the coefficients the
  setup is told, and by what (``loss_fn``'s weight, or
  ``grad_reduction="window_mean"``), where they differ.
  """
  a, w = flat(applied), flat(whole)
  g = np.stack([flat(x) for x in micro_grads])
  k = len(micro_grads)
  error = _rel(a, w)
  if right is None:
    right = [float(n) / float(sum(tokens)) for n in tokens]
  if error <= tol:
    return GradientFit(error, "whole", 1.0, [float(c) for c in right] or None)
  if not norm(a) > 0:
    return GradientFit(error, "none", 0.0, None, "nothing was applied")
  coef, *_ = np.linalg.lstsq(g.T, a, rcond=None)
  combination = norm(a - g.T @ coef) / norm(a) <= tol
  coefficients = [float(c) for c in coef] if combination else None
  share = (float(tokens[-1]), float(sum(tokens)))
  if declared is not None and _rel(a, np.asarray(declared[0]) @ g) <= tol:
    return GradientFit(
      error,
      "declared",
      1.0,
      coefficients,
      f"it weighs the micro-batches {_vector(declared[0])}, as {declared[1]} "
      f"says, the whole batch {_vector(right)}",
    )
  if k > 1:
    missing = _missing_micro_batches(a, g, coefficients, share, tol)
    if missing is not None:
      kind, c, what = missing
      return GradientFit(error, kind, c, coefficients, what)
  uniform = g.mean(axis=0)
  c, e = _scaled(a, uniform)
  if e <= tol and _rel(uniform, w) > tol:
    how = "" if abs(c - 1) <= 1e-3 else f", {_scale_name(c, k, share)}"
    return GradientFit(
      error, "uniform", c, coefficients, f"the mean of micro-batch means{how}"
    )
  c, e = _scaled(a, w)
  if e <= tol:
    return GradientFit(
      error, "scaled", c, coefficients, f"the whole batch's gradient {c:.3g} times"
    )
  return GradientFit(error, "other", 1.0, coefficients, _other(coefficients, right))


def _other(coefficients: list[float] | None, right: Sequence[float]) -> str:
  """What an applied gradient no known bug explains is, beside the whole
  batch's weighting (``right``; empty where it is no combination)."""
  if coefficients is None:
    return "it is no combination of the window's micro-batch gradients"
  if len(right):
    return (
      f"it weighs the micro-batches {_vector(coefficients)}, the whole batch "
      f"{_vector(right)}"
    )
  return (
    f"it weighs the micro-batches {_vector(coefficients)}; the whole batch's "
    "gradient is no combination of theirs"
  )


def _vector(c: Sequence[float]) -> str:
  return "[" + ", ".join(f"{float(x):.3g}" for x in c) + "]"


def _scaled(a: np.ndarray, d: np.ndarray) -> tuple[float, float]:
  """The best ``c`` in ``a = c * d``, and the relative error left."""
  c = float(a @ d / max(d @ d, 1e-300))
  return c, norm(a - c * d) / norm(a)


def _missing_micro_batches(
  a: np.ndarray,
  g: np.ndarray,
  coefficients: list[float] | None,
  share: tuple[float, float],
  tol: float,
) -> tuple[str, float, str] | None:
  """``(kind, scale, what)`` if ``a`` leaves micro-batches out, else ``None``:
  ``"last"`` when it is a multiple of the last one's gradient, ``"dropped"``
  when a combination of them gives some (nearly) no weight."""
  k = len(g)
  c, e = _scaled(a, g[-1])
  if e <= tol:
    how = _scale_name(c, k, share)
    return "last", c, f"the last micro-batch's gradient alone, {how}"
  if coefficients is None:
    return None
  largest = max(abs(x) for x in coefficients)
  # A micro-batch whose gradient is 0 (padding only) cannot tell.
  dropped = [
    i + 1
    for i, x in enumerate(coefficients)
    if abs(x) <= DROPPED * largest and norm(g[i]) > 0
  ]
  if dropped:
    return "dropped", 1.0, f"micro-batches {dropped} of {k} are not in it"
  return None


def leaf_names(tree: Any) -> list[str]:
  return [
    jax.tree_util.keystr(path).removesuffix(".value")
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
  ]


def _leaf_norms(a: Any, b: Any | None = None) -> np.ndarray:
  """Per-leaf norm of ``a``, or of ``a - b``."""
  la = [np.asarray(x, np.float64) for x in jax.tree.leaves(a)]
  if b is not None:
    lb = [np.asarray(x, np.float64) for x in jax.tree.leaves(b)]
    la = [x - y for x, y in zip(la, lb, strict=True)]
  return np.array([np.linalg.norm(x) for x in la])


def rounding_level_leaves(whole: Any, resummed: Any) -> list[int]:
  """Leaves whose whole-batch gradient is rounding noise.

  The same gradient summed in another order (the micro-batches' token-weighted
  sum) differs in these by more than :data:`ROUNDING_LEVEL` of its size: the
  true gradient is zero or nearly (an attention key bias: softmax does not
  see a constant added to every key). Adam scales such noise to full steps,
  differently in any two runs.
  """
  size = _leaf_norms(whole)
  noise = _leaf_norms(whole, resummed)
  return [
    i for i in range(len(size)) if size[i] > 0 and noise[i] > ROUNDING_LEVEL * size[i]
  ]


@dataclasses.dataclass
class ParamsComparison:
  """Per-leaf distance of the setup's params from the whole batch's.

  Attributes:
    diff: Relative distance of all params after the last update.
    rounding: The same for the whole batch summed in another order: what
      rounding alone does on this model and optimizer.
    first_off: The first update (1-based) after which some leaf is further
      than ``tol`` of its size plus :data:`ROUNDING_MARGIN` times its rounding
      distance; ``None`` if none is.
    worst: At ``first_off``: the leaf furthest past its allowance, its
      distance and its rounding distance (both relative to its size).
  """

  diff: float
  rounding: float
  first_off: int | None
  worst: tuple[str, float, float] | None


def compare_params(
  reference: Sequence[Any],
  resummed: Sequence[Any],
  mine: Sequence[Any],
  skip: Sequence[int],
  tol: float,
) -> ParamsComparison:
  names = leaf_names(reference[0])
  last = len(reference) - 1
  ref_last, mine_last = flat(reference[last]), flat(mine[last])
  out = ParamsComparison(
    diff=_rel(mine_last, ref_last),
    rounding=_rel(flat(resummed[last]), ref_last),
    first_off=None,
    worst=None,
  )
  for n, (ref, other, own) in enumerate(zip(reference, resummed, mine, strict=True)):
    size = _leaf_norms(ref)
    dist = _leaf_norms(own, ref)
    noise = _leaf_norms(other, ref)
    allowed = tol * size + ROUNDING_MARGIN * noise
    excess = np.where(dist > allowed, dist / np.maximum(allowed, 1e-300), 0.0)
    excess[list(skip)] = 0.0
    if np.any(excess > 0):
      i = int(np.argmax(excess))
      scale = max(float(size[i]), 1e-30)
      out.first_off = n + 1
      out.worst = (names[i], float(dist[i]) / scale, float(noise[i]) / scale)
      break
  return out
