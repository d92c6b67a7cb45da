"""`audit` with loss terms: a term weighted by the wrong count is named.

A three-term objective (a token-mean cross-entropy, a per-sequence KL, a
per-micro-batch balancing loss) on micro-batches of very different sizes (one
holds only padding: the token and sequence terms weigh 0 there), audited on
each path `audit` resolves: the library's step, `optax_accum.MultiSteps` and
`optax.MultiSteps` passed as the optimizer, the accumulator inside
`optax.chain`, and a loop of the user's. docs/audit.md lists the setups.
"""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import optax_accum

V, D, T, B, K = 11, 8, 8, 16, 4
NAMES = ("ce", "kl", "aux")
ADAMW = optax.inject_hyperparams(optax.adamw)(
  learning_rate=optax.linear_schedule(2e-2, 2e-3, 6)
)
LINEAR_TO_0 = optax.inject_hyperparams(optax.adamw)(
  learning_rate=optax.linear_schedule(1e-2, 0.0, 4)
)
# Micro-batch i holds rows i, i + 4, i + 8, i + 12 (audit's default split):
# tokens [8, 31, 0, 4], sequences [1, 4, 0, 3], and one micro-batch of padding.
LENGTHS = np.array([8, 8, 0, 1, 0, 8, 0, 2, 0, 7, 0, 0, 0, 8, 0, 1])


def init_params(seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  return {
    "embed": jax.random.normal(keys[0], (V, D)),
    "hidden": {"w": jax.random.normal(keys[1], (D, D)) / D**0.5, "b": jnp.zeros(D)},
    "head": {"w": jax.random.normal(keys[2], (D, V)) / D**0.5, "b": jnp.zeros(V)},
  }


def make_batch(seed=0):
  tokens = np.random.default_rng(seed).integers(0, V, (B, T + 1))
  mask = np.arange(T)[None, :] < LENGTHS[:, None]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _terms(params, batch):
  """The three terms' values, and the token and sequence counts."""
  h = params["embed"][batch["inputs"]] @ params["hidden"]["w"]
  logits = jnp.tanh(h + params["hidden"]["b"][None, None]) @ params["head"]["w"]
  logits = logits + params["head"]["b"][None, None]
  mask = jnp.asarray(batch["mask"], jnp.float32)
  tokens, per_row = mask.sum(), mask.sum(-1)
  sequences = (per_row > 0).sum().astype(jnp.float32)
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  logp = jax.nn.log_softmax(logits)
  kl_token = (jnp.exp(logp) * logp).sum(-1) + jnp.log(V)  # KL(p || uniform)
  kl_sequence = (kl_token * mask).sum(-1) / jnp.maximum(per_row, 1)
  # A balancing loss of the micro-batch's mean prediction: once per micro-batch.
  mean_p = (jnp.exp(logp) * mask[..., None]).sum((0, 1)) / jnp.maximum(tokens, 1)
  return {
    "ce": (nll * mask).sum() / jnp.maximum(tokens, 1),
    "kl": 0.5 * kl_sequence.sum() / jnp.maximum(sequences, 1),
    "aux": 0.5 * V * jnp.sum(mean_p**2),
  }, (tokens, sequences)


def terms_loss(params, batch):
  """Each term a mean over its own items, with their count as its weight."""
  value, (tokens, sequences) = _terms(params, batch)
  return {
    "ce": (value["ce"], tokens),
    "kl": (value["kl"], sequences),
    "aux": (value["aux"], jnp.ones([])),
  }


def kl_by_tokens_loss(params, batch):
  """The bug: every term but the per-micro-batch one given the token count."""
  value, (tokens, _) = _terms(params, batch)
  return {
    "ce": (value["ce"], tokens),
    "kl": (value["kl"], tokens),
    "aux": (value["aux"], jnp.ones([])),
  }


def kl_summed_loss(params, batch):
  """The bug: the KL term summed over sequences, with a mean's weight."""
  value, (tokens, sequences) = _terms(params, batch)
  return {
    "ce": (value["ce"], tokens),
    "kl": (value["kl"] * jnp.maximum(sequences, 1), sequences),
    "aux": (value["aux"], jnp.ones([])),
  }


@functools.cache
def summed_terms_loop(optimizer, k):
  """The terms summed into one loss before the accumulator sees them, under
  the token count: every term weighted by tokens."""
  ms = optax_accum.MultiSteps(optimizer, k)

  @jax.jit
  def step(params, state, micro_batch):
    def loss(p):
      terms = terms_loss(p, micro_batch)
      return sum(value for value, _ in terms.values()), terms["ce"][1]

    grads, tokens = jax.grad(loss, has_aux=True)(params)
    updates, state = ms.update(grads, state, params, weight=tokens)
    return optax.apply_updates(params, updates), state

  return ms.init, step


# --- a loop of the user's: each term's weighted sum over the window, divided by
# that term's total weight, with the bugs as switches -----------------------------


@jax.jit
def _add(params, sums, totals, micro_batch, kl_by_tokens, aux_scale):
  """One micro-batch into each term's sum: `sum_t += w_t * grad(value_t)`."""
  _, pullback, weights = jax.vjp(lambda p: _pairs(p, micro_batch), params, has_aux=True)
  ce_w, kl_w, aux_w = weights
  kl_w = jnp.where(kl_by_tokens, ce_w, kl_w)
  scales = (ce_w, kl_w, aux_w * aux_scale)
  new_sums, new_totals = [], []
  for t, (s, n) in enumerate(zip(sums, totals, strict=True)):
    one_hot = tuple(jnp.ones([]) if u == t else jnp.zeros([]) for u in range(3))
    (g,) = pullback(one_hot)
    new_sums.append(jax.tree.map(lambda a, x, w=scales[t]: a + w * x, s, g))
    new_totals.append(n + (ce_w, kl_w, aux_w)[t])
  return tuple(new_sums), tuple(new_totals)


def _pairs(params, batch):
  terms = terms_loss(params, batch)
  return tuple(terms[n][0] for n in NAMES), tuple(terms[n][1] for n in NAMES)


@functools.cache
def _apply(optimizer):
  @jax.jit
  def apply(params, opt_state, sums, totals):
    parts = [
      jax.tree.map(lambda a, n=n: jnp.where(n > 0, a / jnp.maximum(n, 1e-30), 0), s)
      for s, n in zip(sums, totals, strict=True)
    ]
    grads = jax.tree.map(lambda *g: sum(g), *parts)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return apply


def terms_loop(kl_by_tokens=False, aux_scales=(1.0,) * K, drop=None):
  """`(optimizer, k) -> (init, step)`, correct unless `kl_by_tokens` (the KL
  term's sum weighted by tokens), `aux_scales` (the aux term multiplied by these
  in micro-batches 1..k: by k, a trainer's `loss * k` meant to undo its `1/k`)
  or `drop` (that micro-batch, 0-based, left out). Every variant runs the same
  compiled `_add`."""

  @functools.cache
  def accumulation(optimizer, k):
    apply = _apply(optimizer)

    def init(params):
      zeros = jax.tree.map(jnp.zeros_like, params)
      return optimizer.init(params), (zeros,) * 3, (jnp.zeros([]),) * 3, 0

    def step(params, state, micro_batch):
      opt_state, sums, totals, i = state
      if i % k != drop:
        sums, totals = _add(
          params, sums, totals, micro_batch, kl_by_tokens, aux_scales[i % k]
        )
      if i % k == k - 1:
        params, opt_state = apply(params, opt_state, sums, totals)
        sums = jax.tree.map(jnp.zeros_like, sums)
        totals = (jnp.zeros([]),) * 3
      return params, (opt_state, sums, totals, i + 1)

    return init, step

  return accumulation


def _chained(optimizer):
  return optax.chain(
    optax_accum.MultiSteps(optimizer, K, terms=NAMES).gradient_transformation(),
    optax.scale(1.0),
  )


# name: (loss_fn, optimizer, accumulation, failures found, pattern in the terms
# verdict's detail, or in the first failure's).
CORPUS = {
  "three terms in optax_accum.make_train_step (default)": (
    terms_loss,
    ADAMW,
    None,
    set(),
    r"each term weighted by its own weight over the window",
  ),
  "three terms, a hand loop, linear to 0 at update 5": (
    terms_loss,
    LINEAR_TO_0,
    terms_loop(),
    set(),
    r"each term weighted by its own weight over the window",
  ),
  "loss_fn gives the KL term the token count": (
    kl_by_tokens_loss,
    optax_accum.MultiSteps(ADAMW, K, terms=NAMES),
    None,
    {"terms"},
    r"term 'kl' has weight \[8, 31, 0, 4\] \(that of 'ce'\), but its value is a "
    r"mean over another count: on the whole batch it weighs the micro-batches in "
    r"proportion to \[1, 4, 0, 3\]",
  ),
  "a hand loop gives the KL term the token count": (
    terms_loss,
    ADAMW,
    terms_loop(kl_by_tokens=True),
    {"terms"},
    r"term 'kl' is weighted by the weight of 'ce' \[8, 31, 0, 4\] where its own "
    r"weight is \[1, 4, 0, 3\]$",
  ),
  "a hand loop multiplies the aux term by the micro-batch count": (
    terms_loss,
    ADAMW,
    terms_loop(aux_scales=(float(K),) * K),
    {"terms"},
    r": term 'aux' is scaled by the number of micro-batches \(4x\)$",
  ),
  "a hand loop leaves the aux term out": (
    terms_loss,
    ADAMW,
    terms_loop(aux_scales=(0.0,) * K),
    {"terms"},
    r": term 'aux' is missing from the gradient$",
  ),
  "a hand loop weighs the aux term's micro-batches 1, 3, 0, 2": (
    terms_loss,
    ADAMW,
    terms_loop(aux_scales=(1.0, 3.0, 0.0, 2.0)),
    {"terms"},
    r": term 'aux' weighs the micro-batches \[0.25, 0.75, 0, 0.5\] where its weight "
    r"asks for \[0.25, 0.25, 0.25, 0.25\]$",
  ),
  "a hand loop drops micro-batch 1": (
    terms_loss,
    ADAMW,
    terms_loop(drop=0),
    {"F6"},
    r"the gradient is F6's, in every term",
  ),
  "loss_fn reports the KL term as a sum with a mean's weight": (
    kl_summed_loss,
    ADAMW,
    None,
    {"terms"},
    r"term 'kl' is a sum over its items \(on the whole batch it is the "
    r"micro-batches' sum\) with the weight \[1, 4, 0, 3\] of a mean",
  ),
  "a hand loop sums the terms under the token count": (
    terms_loss,
    ADAMW,
    summed_terms_loop,
    {"terms"},
    r"term 'kl' is weighted by the weight of 'ce' \[8, 31, 0, 4\] where its own "
    r"weight is \[1, 4, 0, 3\]; term 'aux' is weighted by the weight of 'ce' "
    r"\[8, 31, 0, 4\] where its own weight is \[1, 1, 1, 1\]$",
  ),
  "optax.MultiSteps passed as the optimizer, the terms summed": (
    terms_loss,
    optax.MultiSteps(ADAMW, K),
    None,
    {"F1"},
    r"the gradient is F1's, in every term",
  ),
  "optax_accum.MultiSteps(terms=...) inside optax.chain": (
    terms_loss,
    _chained(ADAMW),
    None,
    set(),
    r"each weight agrees with the whole batch; how the setup weighs the terms is "
    r"not measured",
  ),
}


@pytest.mark.parametrize("name", CORPUS)
def test_terms_corpus(name):
  loss_fn, optimizer, accumulation, found, pattern = CORPUS[name]
  report = optax_accum.audit(
    loss_fn, optimizer, init_params(), make_batch(), k=K, accumulation=accumulation
  )
  assert report.found() == found, str(report)
  assert report.term_weights == {
    "ce": [8, 31, 0, 4],
    "kl": [8, 31, 0, 4] if loss_fn is kl_by_tokens_loss else [1, 4, 0, 3],
    "aux": [1, 1, 1, 1],
  }
  assert re.search(pattern, report.verdicts["terms"].detail), str(report)
  if found:
    assert report.verdicts[sorted(found)[0]].fix, str(report)


def test_a_term_no_weight_describes_and_one_absent_from_the_batch():
  """The aux term given the token count: its whole-batch value is no weighted
  mean of the micro-batches' values. A first term with weight 0 throughout
  (absent from this batch) is audited, not refused."""

  def loss_fn(params, batch):
    terms = terms_loss(params, batch)
    absent = (jnp.zeros([]), jnp.zeros([]))
    return {"absent": absent, **terms, "aux": (terms["aux"][0], terms["ce"][1])}

  report = optax_accum.audit(
    loss_fn, ADAMW, init_params(), make_batch(), k=K, accumulation=terms_loop()
  )
  assert report.found() == {"terms"}, str(report)
  assert report.tokens == [8, 31, 0, 4]
  assert report.term_weights["absent"] == [0, 0, 0, 0]
  assert re.search(
    r"term 'aux' has weight \[8, 31, 0, 4\], a count that adds up over the "
    r"micro-batches, but its value on the whole batch is no weighted mean of "
    r"theirs .*: give it weight 1 per micro-batch$",
    report.verdicts["terms"].detail,
  ), str(report)


def test_terms_mismatch_and_malformed_terms_are_clear_errors():
  params, batch = init_params(), make_batch()
  with pytest.raises(ValueError, match=r"terms=None: pass optax_accum.MultiSteps"):
    optax_accum.audit(terms_loss, optax_accum.MultiSteps(ADAMW, K), params, batch, k=K)
  with pytest.raises(
    ValueError, match=r"has terms=\['ce'\] but `loss_fn` returns no dict of loss terms"
  ):
    optax_accum.audit(
      lambda p, b: terms_loss(p, b)["ce"],
      optax_accum.MultiSteps(ADAMW, K, terms=("ce",)),
      params,
      batch,
      k=K,
    )
  with pytest.raises(ValueError, match=r"term 'kl' must be a pair of scalars"):
    optax_accum.audit(
      lambda p, b: {**terms_loss(p, b), "kl": terms_loss(p, b)["kl"][0]},
      ADAMW,
      params,
      batch,
      k=K,
    )


def test_the_docs_list_every_terms_setup():
  page = (pathlib.Path(__file__).parent.parent / "docs" / "audit.md").read_text()
  table = page.split("## The audit's own test corpus", 1)[1]
  refused = "a term without a weight, or terms that differ from the accumulator's"
  for name in [*CORPUS, refused]:
    assert f"\n| {name} | " in table, name
