"""Loss terms in ``audit``: each term's share of the window, and which term is
weighted by the wrong count.

A ``loss_fn`` that returns ``{name: (value, weight)}`` declares, per term, a
mean over its own items and their count. The window's objective is then
``sum_t (sum_i w_ti v_ti) / (sum_i w_ti)``, so its gradient gives term ``t``'s
gradient in micro-batch ``i`` the coefficient ``w_ti / W_t``. Two things can
be wrong, and each is named by its term:

- **the setup**: the gradient it applies, fitted as a combination of the
  (term, micro-batch) gradients, gives some term other coefficients (the token
  count for a per-sequence term, ``k`` times a per-micro-batch term, ...);
- **the declaration**: where a term's weight adds up over the micro-batches
  (tokens, sequences), the whole batch's own value of the term must be the
  weighted mean of the micro-batches' values; if its gradient is another
  combination of theirs, the weight is not the count its value is a mean over.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from optax_accum._audit._compare import DROPPED, GradientFit, flat, norm
from optax_accum._audit._loops import LossView, term_gradients
from optax_accum._audit._report import FIXES, Verdict
from optax_accum._audit._runs import BatchGradient, compiled, recombined, summed

TermGradFn = Callable[[Any, Any], tuple[tuple[Any, ...], tuple[Any, ...]]]
#: A term counts as weighted wrongly where its share of the gradient differs
#: by more than this fraction of the whole difference (and of the tolerance).
SHARE = 0.05
#: How close a fitted coefficient vector must come to a count to be named by it.
MATCH = 1e-2
#: Singular values below this fraction of the largest are left out of fits:
#: gradients equal up to rounding (a term of the params alone) are one.
RCOND = 1e-5


def loss_terms(
  loss_fn: Callable[..., Any], has_aux: bool, params: Any, batch: Any
) -> tuple[str, ...]:
  """The names of the terms ``loss_fn`` returns, in its order; ``()`` where it
  returns ``(loss, weight)``. A ``ValueError`` for a term that is no pair of
  scalars."""
  names: list[str] = []

  def traced(p: Any, b: Any) -> Any:
    out = loss_fn(p, b)
    by_name = out[0] if has_aux and isinstance(out, tuple) and len(out) == 2 else out
    if isinstance(by_name, dict):
      names.extend(by_name)
    return out

  out = jax.eval_shape(traced, params, batch)
  if not names:
    return ()
  by_name = out[0] if has_aux else out
  for name in names:
    pair = by_name[name]
    if not (
      isinstance(pair, tuple)
      and len(pair) == 2
      and all(isinstance(x, jax.ShapeDtypeStruct) and x.shape == () for x in pair)
    ):
      raise ValueError(
        f"`loss_fn`'s term {name!r} must be a pair of scalars (value, weight): "
        "the mean over its items and their count in this micro-batch."
      )
  return tuple(names)


def term_gradient_fn(loss: LossView) -> TermGradFn:
  """``(params, batch) -> (gradients, weights)``, one per term, compiled."""
  return compiled(term_gradients, loss)


@dataclasses.dataclass(frozen=True)
class TermsBatch:
  """Each loss term over one batch and its micro-batches.

  Attributes:
    names: The terms, in ``loss_fn``'s order.
    grads: ``grads[t][i]``: term ``t``'s (mean) gradient in micro-batch ``i``.
    weights: ``weights[t, i]``: its weight there.
    whole: Each term's gradient on the whole batch where its weight there is
      the micro-batches' total (a count that adds up); ``None`` elsewhere (a
      value per micro-batch: weight 1 each).
  """

  names: tuple[str, ...]
  grads: list[list[Any]]
  weights: np.ndarray
  whole: list[Any | None]

  def expected(self, without: Sequence[int] = ()) -> np.ndarray:
    """``w_ti / W_t``: each term's coefficients in the window's gradient (the
    window without the micro-batches ``without``, 1-based)."""
    weights = self.weights.copy()
    weights[:, [i - 1 for i in without]] = 0
    totals = weights.sum(axis=1, keepdims=True)
    return np.where(totals > 0, weights / np.where(totals > 0, totals, 1), 0.0)

  def recombined(self, t: int, like: Any) -> Any:
    """Term ``t``'s weighted mean over the micro-batches (0 without weight)."""
    if not self.weights[t].sum() > 0:
      return jax.tree.map(lambda x: x * 0, self.grads[t][0])
    return recombined(self.grads[t], [float(w) for w in self.weights[t]], like)

  def consistent(self, t: int, like: Any, tol: float) -> bool:
    """Whether term ``t``'s whole-batch gradient is its weighted mean over the
    micro-batches (``True`` where the whole batch cannot say)."""
    whole = self.whole[t]
    if whole is None or not self.weights[t].sum() > 0:
      return True
    w, r = flat(whole), flat(self.recombined(t, like))
    return norm(w - r) <= tol * max(norm(w), 1e-30)

  def silent(self) -> list[str]:
    """Terms with no gradient at these params (a KL at its minimum), whose
    weighting the window's gradient cannot show."""
    norms = [max(norm(flat(g)) for g in row) for row in self.grads]
    return [
      name
      for name, n in zip(self.names, norms, strict=True)
      if not n > 1e-6 * max(norms)
    ]

  def reference(self, like: Any, tol: float) -> list[Any]:
    """Each term's whole-batch gradient: its own on the whole batch where that
    is its weighted mean, else the weighted mean of its micro-batches'."""
    whole = self.whole
    return [
      whole[t]
      if whole[t] is not None and self.consistent(t, like, tol)
      else self.recombined(t, like)
      for t in range(len(self.names))
    ]


def measure(
  grad_fn: TermGradFn,
  names: tuple[str, ...],
  params: Any,
  batch: Any,
  micro: Sequence[Any],
  whole: bool = True,
) -> TermsBatch:
  """The :class:`TermsBatch` of ``batch``; with ``whole=False`` the whole
  batch's own gradients are not taken."""
  pairs = [grad_fn(params, m) for m in micro]
  n = len(names)
  grads = [[g[t] for g, _ in pairs] for t in range(n)]
  weights = np.array([[float(w[t]) for _, w in pairs] for t in range(n)])
  own: list[Any | None] = [None] * n
  if whole:
    whole_grads, whole_weights = grad_fn(params, batch)
    for t in range(n):
      total = float(weights[t].sum())
      if abs(float(whole_weights[t]) - total) <= 1e-6 * max(abs(total), 1.0):
        own[t] = whole_grads[t]
  return TermsBatch(names, grads, weights, own)


def batch_gradient(
  grad_fn: TermGradFn,
  names: tuple[str, ...],
  tol: float,
  *,
  resum: bool,
  by_term: bool,
) -> BatchGradient:
  """The whole batch's gradient with terms: the sum of each term's (with
  ``resum``, each term's weighted mean over the micro-batches: rounding away
  from the other). ``by_term``: dicts by term name of gradients and weights,
  for an ``optax_accum.MultiSteps(terms=...)`` inside the optimizer."""

  def gradient(params: Any, batch: Any, micro: Sequence[Any]) -> tuple[Any, Any]:
    terms = measure(grad_fn, names, params, batch, micro, whole=not resum)
    per_term = terms.reference(params, tol)
    totals = [float(w) for w in terms.weights.sum(axis=1)]
    if by_term:
      return dict(zip(names, per_term, strict=True)), dict(
        zip(names, totals, strict=True)
      )
    return summed(per_term), totals[0]

  return gradient


def _unit(columns: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
  """``columns`` (rows) scaled to norm 1 (zero rows left 0), and the scales."""
  norms = np.linalg.norm(columns, axis=1)
  scale = np.where(norms > 0, norms, 1.0)
  return columns / scale[:, None], scale


def _rank(columns: np.ndarray) -> int:
  """The rank of ``columns`` scaled to norm 1, up to :data:`RCOND`."""
  s = np.linalg.svd(_unit(columns)[0], compute_uv=False)
  return int((s > RCOND * s.max()).sum()) if s.size and s.max() > 0 else 0


def _fit(columns: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
  """Least-squares ``target = columns.T @ c`` over columns scaled to norm 1
  (so gradients equal up to rounding count once); ``c`` and the relative
  residual."""
  unit, scale = _unit(columns)
  norms = np.linalg.norm(columns, axis=1)
  coef, *_ = np.linalg.lstsq(unit.T, target, rcond=RCOND)
  coef = np.where(norms > 0, coef / scale, 0.0)
  residual = norm(target - columns.T @ coef) / max(norm(target), 1e-30)
  return coef, residual


def _counts(v: np.ndarray) -> str:
  """A weight vector for people: whole numbers where they are."""
  if np.allclose(v, np.round(v), rtol=0, atol=1e-3 * max(1.0, float(np.abs(v).max()))):
    return str([int(x) for x in np.round(v)])
  return "[" + ", ".join(f"{x:.3g}" for x in v) + "]"


def _proportion(c: np.ndarray) -> np.ndarray:
  """``c`` scaled so that its smallest positive entry is 1."""
  positive = c[c > 1e-9 * max(float(np.abs(c).max()), 1e-300)]
  return c / positive.min() if positive.size else c


def _named_counts(terms: TermsBatch, t: int) -> list[tuple[str, np.ndarray]]:
  """The counts a term's coefficients are compared with, each once: the
  term's own weight, 1 per micro-batch, and every other term's weight."""
  k = terms.weights.shape[1]
  named = [("its own weight", terms.weights[t]), ("1 per micro-batch", np.ones(k))]
  named += [
    (f"the weight of {name!r}", terms.weights[u])
    for u, name in enumerate(terms.names)
    if u != t
  ]
  out: list[tuple[str, np.ndarray]] = []
  for label, v in named:
    if not v.sum() > 0:
      continue
    unit = v / v.sum()
    if not any(np.allclose(unit, u / u.sum(), rtol=1e-9, atol=1e-12) for _, u in out):
      out.append((label, v))
  return out


def _match(
  g: np.ndarray, c: np.ndarray, counts: list[tuple[str, np.ndarray]]
) -> tuple[str, np.ndarray, float] | None:
  """The first count ``v`` (label, ``v``, scale ``s``) whose normalised form,
  times ``s``, gives the same gradient as the coefficients ``c``: compared
  through the gradients ``g`` (rows), so counts that differ only where the
  gradients cannot tell them apart match alike."""
  d = g.T @ c
  for label, v in counts:
    q = g.T @ (v / v.sum())
    s = float(d @ q / max(float(q @ q), 1e-300))
    if norm(d - s * q) <= MATCH * max(norm(d), 1e-300):
      return label, v, s
  return None


@dataclasses.dataclass(frozen=True)
class TermFit:
  """The first window's applied gradient as a combination of each term's
  micro-batch gradients.

  Attributes:
    coefficients: The fitted coefficient of each term in each micro-batch, by
      term name (least squares; the window's objective gives ``w_ti / W_t``),
      or ``None`` where the gradient is no such combination.
    problems: One line per term weighted otherwise than its weight asks.
    every_term: Whether every term with a gradient is among them (then the
      problem is no term's own).
    separable: Whether the terms' gradients are independent, so that a
      difference can be put down to one term; ``False``: problems is empty.
    dropped: Micro-batches (1-based) no term is in, where without them every
      term is weighted by its own weight: F6, not a term's problem.
  """

  coefficients: dict[str, list[float]] | None
  problems: list[str]
  every_term: bool = False
  separable: bool = True
  dropped: list[int] = dataclasses.field(default_factory=list)


def fit_terms(applied: Any, terms: TermsBatch, tol: float) -> TermFit:
  """Which terms ``applied`` (the window's gradient a setup applied) weighs
  otherwise than ``w_ti / W_t``, and by what count."""
  a = flat(applied)
  n, k = terms.weights.shape
  g = np.stack([np.stack([flat(x) for x in row]) for row in terms.grads])
  coef, residual = _fit(g.reshape(n * k, -1), a)
  if residual > tol:
    return TermFit(None, [])
  c, e = coef.reshape(n, k), terms.expected()
  by_name = {name: [float(v) for v in c[t]] for t, name in enumerate(terms.names)}
  if _rank(g.reshape(n * k, -1)) < sum(_rank(g[t]) for t in range(n)):
    return TermFit(by_name, [], separable=False)
  dropped = _empty_micro_batches(g, c, e)
  if dropped and not _off(a, g, c, terms.expected(dropped), tol):
    return TermFit(by_name, [], dropped=dropped)
  off = _off(a, g, c, e, tol)
  problems = [_misweighted(terms, t, g[t], c[t]) for t in off]
  moving = {t for t, name in enumerate(terms.names) if name not in terms.silent()}
  return TermFit(by_name, problems, every_term=moving <= set(off))


def _off(
  a: np.ndarray, g: np.ndarray, c: np.ndarray, e: np.ndarray, tol: float
) -> list[int]:
  """The terms whose share ``g[t].T @ c[t]`` of ``a`` is not ``g[t].T @ e[t]``."""
  floor = max(tol * norm(a), SHARE * norm(a - np.einsum("tk,tkp->p", e, g)))
  return [t for t in range(len(g)) if norm(g[t].T @ (c[t] - e[t])) > floor]


def _empty_micro_batches(g: np.ndarray, c: np.ndarray, e: np.ndarray) -> list[int]:
  """Micro-batches (1-based) that should add some gradient but add next to none."""
  size = np.linalg.norm(g, axis=2)  # [term, micro-batch]
  added, due = (np.abs(c) * size).sum(0), (e * size).sum(0)
  return [
    i + 1 for i in range(len(added)) if due[i] > 0 and added[i] <= DROPPED * added.max()
  ]


def explain(
  fit: GradientFit, applied: Any, terms: TermsBatch, tol: float
) -> tuple[GradientFit, TermFit | None]:
  """``fit`` (the applied gradient over the micro-batches) read term by term:
  micro-batches no term is in are F6 (``fit.kind`` ``"dropped"``); terms
  weighted otherwise are named (``"terms"``), unless every term is and the
  whole gradient is scaled."""
  if fit.kind in ("whole", "none", "uniform", "last"):
    return fit, None
  term_fit = fit_terms(applied, terms, tol)
  if term_fit.dropped:
    k = terms.weights.shape[1]
    what = f"micro-batches {term_fit.dropped} of {k} are not in it"
    return GradientFit(fit.error, "dropped", 1.0, fit.coefficients, what), term_fit
  if not term_fit.problems or (term_fit.every_term and fit.kind == "scaled"):
    return fit, dataclasses.replace(term_fit, problems=[])
  what = "; ".join(term_fit.problems)
  return GradientFit(fit.error, "terms", 1.0, fit.coefficients, what), term_fit


def _misweighted(terms: TermsBatch, t: int, g: np.ndarray, c: np.ndarray) -> str:
  """What count term ``t``'s fitted coefficients ``c`` are, against its own."""
  name, k = terms.names[t], len(c)
  own, expected = terms.weights[t], terms.expected()[t]
  if norm(g.T @ c) <= MATCH * norm(g.T @ expected):
    return f"term {name!r} is missing from the gradient"
  found = _match(g, c, _named_counts(terms, t))
  label, v, s = found if found else ("", own, 1.0)
  by_k = abs(s - k) <= MATCH * k
  if label == "its own weight" and abs(s - 1) > MATCH:
    if by_k:
      return f"term {name!r} is scaled by the number of micro-batches ({k}x)"
    return f"term {name!r} is scaled {s:.3g}x"
  if not label or label == "its own weight":
    return (
      f"term {name!r} weighs the micro-batches {_counts(c)} where its weight "
      f"asks for {_counts(expected)}"
    )
  how = label if label == "1 per micro-batch" else f"by {label} {_counts(v)}"
  scaled = "" if abs(s - 1) <= MATCH else f", {k}x" if by_k else f", {s:.3g}x"
  return (
    f"term {name!r} is weighted {how}{scaled} where its own weight is {_counts(own)}"
  )


def declaration_problems(terms: TermsBatch, like: Any, tol: float) -> list[str]:
  """Terms whose weight adds up over the micro-batches but is not the count
  their value is a mean over: the whole batch's value weighs the micro-batches
  otherwise."""
  out = []
  for t, name in enumerate(terms.names):
    whole = terms.whole[t]
    if whole is None or terms.consistent(t, like, tol):
      continue
    g = np.stack([flat(x) for x in terms.grads[t]])
    c, residual = _fit(g, flat(whole))
    own = _counts(terms.weights[t])
    if residual > tol:
      out.append(
        f"term {name!r} has weight {own}, a count that adds up over the "
        "micro-batches, but its value on the whole batch is no weighted mean of "
        "theirs (a value of each micro-batch as a whole): give it weight 1 per "
        "micro-batch"
      )
    elif np.allclose(c[np.linalg.norm(g, axis=1) > 0], 1.0, rtol=0, atol=MATCH):
      out.append(
        f"term {name!r} is a sum over its items (on the whole batch it is the "
        f"micro-batches' sum) with the weight {own} of a mean: divide it by that "
        "count"
      )
    else:
      like_term = [
        other
        for u, other in enumerate(terms.names)
        if u != t and np.array_equal(terms.weights[u], terms.weights[t])
      ]
      same = f" (that of {like_term[0]!r})" if like_term else ""
      out.append(
        f"term {name!r} has weight {own}{same}, but its value is a mean over "
        "another count: on the whole batch it weighs the micro-batches in "
        f"proportion to {_counts(_proportion(c))}; pass the number of items its "
        "value is a mean over as its weight"
      )
  return out


@dataclasses.dataclass(frozen=True)
class TermsEvidence:
  """What the terms verdict weighs.

  Attributes:
    batch: The first batch's terms.
    declared: Terms whose weight is not the count their value is a mean over.
    fit: The applied gradient's fit over the terms; ``None`` where not fitted
      (it matches, F1 or F6 explain it, or there is no probe).
  """

  batch: TermsBatch
  declared: list[str]
  fit: TermFit | None


def terms_verdict(e: TermsEvidence, gradient: GradientFit | None) -> Verdict:
  """The ``terms`` verdict: a term the setup or ``loss_fn`` weighs wrongly."""
  setup = e.fit.problems if e.fit is not None else []
  if setup or e.declared:
    off = f"gradient off by {gradient.error:.1e}: " if setup and gradient else ""
    fix = [FIXES["terms"]] if setup else []
    fix += [FIXES["terms declared"]] if e.declared else []
    return Verdict("FOUND", off + "; ".join(setup + e.declared), "; ".join(fix))
  if gradient is None:
    return Verdict(
      "n/a",
      "each weight agrees with the whole batch; how the setup weighs the terms is "
      "not measured (the accumulator sits inside your optimizer)",
    )
  if gradient.kind == "whole":
    detail = "each term weighted by its own weight over the window"
    silent = e.batch.silent()
    if silent:
      names = ", ".join(repr(name) for name in silent)
      detail += f" (not measured for {names}: no gradient at these params)"
    return Verdict("ok", detail)
  if e.fit is not None and not e.fit.separable:
    return Verdict(
      "n/a",
      "the terms' micro-batch gradients are not independent at these params, so "
      "a difference cannot be put down to one term",
    )
  forms = {
    "uniform": "the gradient is F1's, in every term",
    "last": "the gradient is F6's, in every term",
    "dropped": "the gradient is F6's, in every term",
    "scaled": "every term is scaled alike (see other)",
  }
  if gradient.kind in forms:
    return Verdict("n/a", forms[gradient.kind])
  return Verdict(
    "n/a",
    "the window's gradient is no combination of the terms' micro-batch gradients",
  )
