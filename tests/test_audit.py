"""`audit` gives the exact verdict on each setup, written the way its users wrote it.

The corpus: each seed bug in the form it really takes (optax.MultiSteps on mean
losses, an optimizer stepped on micro-steps in one optimizer or in a later
`optax.multi_transform` branch, with a schedule that reaches 0 and together
with `step % k == 0`, a schedule chained after the accumulator, `step % k ==
0`, the last micro-batch's gradient scaled three ways, the two-function loop
fresh and after one micro-step of drift, a loop that never applies its updates,
one that goes wrong at update 4) and correct setups on models with attention
biases, whose key bias has a gradient at rounding level: the library's own step
with schedules that reach 0, the `grad_reduction="sum"` recipe, a loop that
reads `.hyperparams`. No false OK and no false alarm; docs/audit.md lists them.
"""

import functools
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import toy_lm
from flax import nnx

import optax_accum

V, D, T, B, K = 11, 8, 8, 16, 4
SCHEDULE = optax.linear_schedule(2e-2, 2e-3, 6)


# --- a tiny attention LM, plain pytree -------------------------------------------


def init_params(seed=0):
  keys = iter(jax.random.split(jax.random.key(seed), 7))

  def dense(n_in, n_out):
    w = jax.random.normal(next(keys), (n_in, n_out)) / n_in**0.5
    return {"w": w, "b": jnp.zeros(n_out)}

  return {
    "embed": jax.random.normal(next(keys), (V, D)),
    "attn": {name: dense(D, D) for name in "qkvo"},
    "head": dense(D, V),
  }


def _dense(p, x):
  return x @ p["w"] + p["b"][None, None, :]


def _causal_attention(q, k, v):
  scores = jnp.einsum("btd,bsd->bts", q, k) / D**0.5
  scores = jnp.where(jnp.tril(jnp.ones((T, T), bool))[None], scores, -1e9)
  return jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores), v)


def _summed_ce(logits, batch):
  nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = jnp.asarray(batch["mask"], nll.dtype)
  return (nll * mask).sum(), mask.sum()


def _token_mean_ce(logits, batch):
  total, tokens = _summed_ce(logits, batch)
  return total / tokens, tokens


def _logits(params, batch):
  h = params["embed"][batch["inputs"]]
  a = params["attn"]
  h = h + _dense(a["o"], _causal_attention(*(_dense(a[n], h) for n in "qkv")))
  return _dense(params["head"], jnp.tanh(h))


def mean_loss(params, batch):
  """Token-mean cross-entropy and the number of tokens: `(loss, weight)`."""
  return _token_mean_ce(_logits(params, batch), batch)


def summed_loss(params, batch):
  """The `grad_reduction="sum"` recipe's loss: summed over tokens, and their count."""
  return _summed_ce(_logits(params, batch), batch)


def make_batch(seed=0):
  """Half the sequences 1-2 tokens long, half 4-8: token counts vary."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, V, (B, T + 1))
  lengths = np.where(
    rng.random(B) < 0.5, rng.integers(1, 3, B), rng.integers(T // 2, T + 1, B)
  )
  mask = np.arange(T)[None, :] < lengths[:, None]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def _grads(params, micro_batch):
  return jax.grad(mean_loss, has_aux=True)(params, micro_batch)


# --- optimizers ------------------------------------------------------------------


def adamw(injected=True):
  if injected:
    return optax.inject_hyperparams(optax.adamw)(learning_rate=SCHEDULE)
  return optax.adamw(SCHEDULE)


def three_groups(injected=True):
  """Three AdamW groups; only the last ('head', in tree order) is scheduled."""

  def group(lr):
    return (
      optax.inject_hyperparams(optax.adamw)(learning_rate=lr)
      if injected
      else (optax.adamw(lr))
    )

  return optax.multi_transform(
    {"attn": group(1e-2), "embed": group(1e-2), "head": group(SCHEDULE)},
    lambda params: {
      name: jax.tree.map(lambda _, n=name: n, sub) for name, sub in params.items()
    },
  )


ADAMW, ADAMW_PLAIN = adamw(), adamw(injected=False)
GROUPS, GROUPS_PLAIN = three_groups(), three_groups(injected=False)
# Schedules that reach 0 within the audited updates: the whole batch stops moving.
WARMUP_COSINE_TO_0 = optax.inject_hyperparams(optax.adamw)(
  learning_rate=optax.warmup_cosine_decay_schedule(1e-3, 1e-2, 1, 3)
)
LINEAR_TO_0 = optax.inject_hyperparams(optax.adamw)(
  learning_rate=optax.linear_schedule(1e-2, 0.0, 4)
)


# --- the corpus: setups as their users wrote them ---------------------------------
#
# A script builds its jitted functions once; `functools.cache` does the same
# here, per optimizer and k, so the restart the audit simulates (the setup
# built again) finds them compiled, with fresh Python counters around them.


@functools.cache
def optax_multisteps_loop(optimizer, k, use_grad_mean=True):
  """The usual optax.MultiSteps loop: each micro-batch's mean-loss gradient."""
  ms = optax.MultiSteps(optimizer, k, use_grad_mean=use_grad_mean)

  @jax.jit
  def step(params, state, micro_batch):
    grads, _ = _grads(params, micro_batch)
    updates, state = ms.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return ms.init, step


def summing_multisteps_loop(optimizer, k):
  return optax_multisteps_loop(optimizer, k, use_grad_mean=False)


def micro_stepped_optimizer(ends_window):
  """Token-weighted, but `optimizer.update` (schedule and all) runs every micro-step.

  A port of a PyTorch loop that steps its scheduler on every backward: the
  state advances each time, only the update where `ends_window` says is applied.
  """

  @functools.cache
  def accumulation(optimizer, k):
    return _micro_stepped(optimizer, k, ends_window)

  return accumulation


def _micro_stepped(optimizer, k, ends_window):
  """`(init, step)` of `micro_stepped_optimizer(ends_window)(optimizer, k)`."""

  def init(params):
    return (
      optimizer.init(params),
      jax.tree.map(jnp.zeros_like, params),
      jnp.zeros(()),
      0,
    )

  @jax.jit
  def accumulate(params, opt_state, acc, total, micro_batch):
    grads, n = _grads(params, micro_batch)
    acc = jax.tree.map(lambda a, g: a + n * g, acc, grads)
    mean = jax.tree.map(lambda a: a / (total + n), acc)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return updates, opt_state, acc, total + n

  def step(params, state, micro_batch):
    opt_state, acc, total, i = state
    updates, opt_state, acc, total = accumulate(
      params, opt_state, acc, total, micro_batch
    )
    if ends_window(i, k):
      params = optax.apply_updates(params, updates)
      acc, total = jax.tree.map(jnp.zeros_like, acc), jnp.zeros(())
    return params, (opt_state, acc, total, i + 1)

  return init, step


def at_window_end(i, k):
  return i % k == k - 1


optimizer_on_every_micro_step = micro_stepped_optimizer(at_window_end)
# F3 and F4 in one loop, as the PyTorch loop shipped: the scheduler stepped on
# every backward, and the update applied where `step % k == 0`.
pytorch_loop = micro_stepped_optimizer(lambda i, k: i % k == 0)


@jax.jit
def _add_micro_batch(params, acc, total, micro_batch):
  grads, n = _grads(params, micro_batch)
  return jax.tree.map(lambda a, g: a + n * g, acc, grads), total + n


@functools.cache
def _apply_window(optimizer):
  @jax.jit
  def apply(params, opt_state, acc, total):
    mean = jax.tree.map(lambda a: a / total, acc)
    updates, opt_state = optimizer.update(mean, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  return apply


def hand_loop(ends_window, *, python_counter=False, empties=None, logs_lr=False):
  """A token-weighted loop: `acc += n * g`, the optimizer where `ends_window` says.

  With `python_counter` the micro-step count lives in the loop, not the state.
  `empties(update)` (1-based) says whether the sum is emptied after that update
  (always, by default). With `logs_lr` the loop reads the learning rate from
  its optimizer state (`opt_state.hyperparams`) at each update, for its log.
  """

  def accumulation(optimizer, k):
    apply = _apply_window(optimizer)
    counter = 0
    log = []

    def init(params):
      return (
        optimizer.init(params),
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros(()),
        0,
      )

    def step(params, state, micro_batch):
      nonlocal counter
      opt_state, acc, total, i = state
      if python_counter:
        i, counter = counter, counter + 1
      acc, total = _add_micro_batch(params, acc, total, micro_batch)
      if ends_window(i, k):
        params, opt_state = apply(params, opt_state, acc, total)
        if logs_lr:
          log.append(float(opt_state.hyperparams["learning_rate"]))
        if empties is None or empties(i // k + 1):
          acc, total = jax.tree.map(jnp.zeros_like, acc), jnp.zeros(())
      return params, (opt_state, acc, total, i + 1)

    return init, step

  return accumulation


correct_hand_loop = hand_loop(at_window_end)
correct_hand_loop_python_counter = hand_loop(at_window_end, python_counter=True)
hand_loop_logging_lr = hand_loop(at_window_end, logs_lr=True)
# A bug that starts at update 4: the sum is emptied during warmup only (updates
# 1-2), so update 4 still holds update 3's gradients.
empties_only_in_warmup = hand_loop(at_window_end, empties=lambda update: update <= 2)
# F4: `step % k == 0` on a 0-based count: the first update uses one micro-batch.
off_by_one_loop = hand_loop(lambda i, k: i % k == 0)


def last_micro_batch_only(scaling):
  """F6 as DeepSpeed ZeRO-2 with manual accumulation shipped it: each backward
  overwrites the window's gradient instead of adding to it.

  `scaling`: None; `"loss / k"` (each micro-batch's loss divided by k); or
  `"tokens"` (token-weighted: `n * g`, divided by the window's tokens).
  """

  @functools.partial(jax.jit, static_argnums=3)
  def backward(params, total, micro_batch, k):
    grads, n = _grads(params, micro_batch)
    if scaling == "loss / k":
      grads = jax.tree.map(lambda g: g / k, grads)
    if scaling == "tokens":
      grads = jax.tree.map(lambda g: n * g, grads)
    return grads, total + n

  @functools.cache
  def accumulation(optimizer, k):
    def init(params):
      return (
        optimizer.init(params),
        jax.tree.map(jnp.zeros_like, params),
        jnp.zeros(()),
        0,
      )

    @jax.jit
    def apply(params, opt_state, grads, total):
      if scaling == "tokens":
        grads = jax.tree.map(lambda g: g / total, grads)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state

    def step(params, state, micro_batch):
      opt_state, _, total, i = state
      grads, total = backward(params, total, micro_batch, k)  # Should add to it.
      if i % k == k - 1:
        params, opt_state = apply(params, opt_state, grads, total)
        total = jnp.zeros(())
      return params, (opt_state, grads, total, i + 1)

    return init, step

  return accumulation


last_only_unscaled = last_micro_batch_only(None)
last_only_over_k = last_micro_batch_only("loss / k")
last_only_token_share = last_micro_batch_only("tokens")


@functools.cache
def _accumulate_and_apply(optimizer, k):
  """The two jitted functions of the optax user's loop."""
  ms = optax.MultiSteps(optimizer, k)

  @jax.jit
  def accumulate(params, state, micro_batch):
    grads, _ = _grads(params, micro_batch)
    _, state = ms.update(grads, state, params)
    return state

  @jax.jit
  def apply(params, state, micro_batch):
    grads, _ = _grads(params, micro_batch)
    updates, state = ms.update(grads, state, params)
    return optax.apply_updates(params, updates), state

  return ms.init, accumulate, apply


def two_function_loop(drift=0):
  """The optax user's loop: `accumulate` drops what optax.MultiSteps returns,
  `apply` applies it, and a Python micro-step counter picks which to call.

  Correct while the counter and `mini_step` agree; `drift` starts the counter
  that many micro-steps off (a skipped bad batch, a resumed run).
  """

  def accumulation(optimizer, k):
    init, accumulate, apply = _accumulate_and_apply(optimizer, k)
    micro_step = drift

    def step(params, state, micro_batch):
      nonlocal micro_step
      micro_step += 1
      if micro_step % k == 0:
        return apply(params, state, micro_batch)
      return params, accumulate(params, state, micro_batch)

    return init, step

  return accumulation


@functools.cache
def never_applies(optimizer, k):
  """The update is computed and `optax.apply_updates`' result dropped."""
  ms = optax_accum.MultiSteps(optimizer, k)

  @jax.jit
  def step(params, state, micro_batch):
    grads, n = _grads(params, micro_batch)
    updates, state = ms.update(grads, state, params, weight=n)
    optax.apply_updates(params, updates)
    return params, state

  return ms.init, step


def _audit(setup, optimizer=ADAMW, loss_fn=mean_loss, **kwargs):
  return optax_accum.audit(
    loss_fn,
    optimizer,
    kwargs.pop("params", None) or init_params(),
    kwargs.pop("batch", None) or make_batch(),
    k=K,
    accumulation=setup,
    **kwargs,
  )


def _token_share():
  mask = make_batch()["mask"]
  tokens = [float(mask[i::K].sum()) for i in range(K)]
  return tokens[-1] / sum(tokens)


def _only_last(scale):
  """Checks on an F6 report: the fitted scale, and no weight on the others."""

  def check(report):
    assert report.grad_scale == pytest.approx(scale(), rel=1e-4)
    np.testing.assert_allclose(report.micro_batch_weights[:-1], 0, atol=1e-4)

  return check


def _accumulator_as_optimizer(report):
  assert report.setup.startswith("optax.MultiSteps in the usual loop")
  assert report.expected_changes == [False, False, False, True] * 3
  assert report.grad_error == pytest.approx(report.mean_of_means_bias, rel=1e-3)


def _every_group_compared(report):
  assert set(report.lr_reference) == {"attn", "embed", "head"}
  np.testing.assert_allclose(
    report.lr_reference["head"], [SCHEDULE(n) for n in range(5)], rtol=1e-6
  )
  np.testing.assert_allclose(
    report.lr["head"], [SCHEDULE(K * n + K - 1) for n in range(5)], rtol=1e-6
  )
  np.testing.assert_allclose(report.lr["attn"], report.lr_reference["attn"])


def _applies_every_update_but_lr_is_0(report):
  """Params never change, yet the loop applies every update: F3, not F7."""
  assert not any(report.changed) and report.applied == report.expected_applied
  assert report.verdicts["F7"].status == "ok"
  assert "zero updates (F3)" in report.verdicts["F7"].detail


def _f4_names_where_updates_land(report):
  """F4 says where updates land; F3 says why none move the params after the first."""
  assert report.changed[:K] == [True, False, False, False]
  assert not any(report.changed[K:]) and not any(report.resumed)
  f4 = report.verdicts["F4"].detail
  assert f4.startswith("an update is applied after micro-step 1; windows end every 4")
  assert "learning rate" not in f4
  assert report.verdicts["F7"].status == "ok"


def _compares_after_the_restart(report):
  """Updates 1-3 match; the restart segment is compared too, and says so."""
  assert report.updates_compared == 5
  assert "k=4, updates 1-5 against the whole batch" in str(report)
  fix = report.verdicts["other"].fix
  assert "updates 1-3 match" in fix and "an accumulator not emptied" in fix


def _chained_layout_is_audited_as_written(report):
  assert report.setup.startswith("your optimizer (an optax_accum.MultiSteps inside")
  assert report.verdicts["F1"].status == "n/a"
  assert "inside your optimizer" in report.verdicts["F1"].detail
  assert "optax_accum.MultiSteps(optax.chain(" in report.verdicts["F3"].fix


def _fine_until_the_restart(report):
  assert report.changed == report.expected_changes  # Fresh, it looks right...
  assert report.resumed[0] is False and not any(report.resumed[1:])  # ...then not.
  assert "froze after a restart one micro-step into a window" in (
    report.verdicts["F7"].detail
  )


# name: (accumulation, optimizer, failures found, pattern in the first one's
# detail, further checks). `None` as accumulation with an accumulator as the
# optimizer: what a user checking an existing optax.MultiSteps writes.
CORPUS = {
  "optax.MultiSteps passed as the optimizer": (
    None,
    optax.MultiSteps(ADAMW, K),
    {"F1"},
    r"it is the mean of micro-batch means \(tokens \d+-\d+\)",
    _accumulator_as_optimizer,
  ),
  "optax.MultiSteps in the usual loop": (
    optax_multisteps_loop,
    ADAMW,
    {"F1"},
    r"mean of micro-batch means \(",
    None,
  ),
  "optax.MultiSteps(use_grad_mean=False)": (
    summing_multisteps_loop,
    ADAMW,
    {"F1"},
    r"means, times k = 4",
    None,
  ),
  "optimizer on every micro-step, injected schedule": (
    optimizer_on_every_micro_step,
    ADAMW,
    {"F3"},
    r"learning rate is 0.011 at update 1 \(whole batch: 0.02\)",
    None,
  ),
  "optimizer on every micro-step, plain schedule": (
    optimizer_on_every_micro_step,
    ADAMW_PLAIN,
    {"F3"},
    r"step count is 12 after 3 updates \(whole batch: 3\)",
    None,
  ),
  "optimizer on every micro-step, injected, third multi_transform group": (
    optimizer_on_every_micro_step,
    GROUPS,
    {"F3"},
    r"learning rate of head is 0.011 at update 1",
    _every_group_compared,
  ),
  "optimizer on every micro-step, plain, third multi_transform group": (
    optimizer_on_every_micro_step,
    GROUPS_PLAIN,
    {"F3"},
    r"step count is 12 after 3 updates",
    None,
  ),
  "step % k == 0": (
    off_by_one_loop,
    ADAMW,
    {"F4"},
    r"an update is applied after micro-step 1; windows end every 4",
    None,
  ),
  "last micro-batch only, unscaled": (
    last_only_unscaled,
    ADAMW,
    {"F6"},
    r"last micro-batch's gradient alone, unscaled",
    _only_last(lambda: 1.0),
  ),
  "last micro-batch only, loss / k": (
    last_only_over_k,
    ADAMW,
    {"F6"},
    r"alone, scaled by 1/k = 1/4",
    _only_last(lambda: 1 / K),
  ),
  "last micro-batch only, token share": (
    last_only_token_share,
    ADAMW,
    {"F6"},
    r"alone, scaled by its share of the window's tokens, \d+/\d+",
    _only_last(_token_share),
  ),
  "two-function loop, fresh": (
    two_function_loop(),
    ADAMW,
    {"F1", "F7"},
    r"mean of micro-batch means",
    _fine_until_the_restart,
  ),
  "two-function loop, one micro-step of drift": (
    two_function_loop(drift=1),
    ADAMW,
    {"F7"},
    r"params never changed",
    None,
  ),
  "never applies its updates": (never_applies, ADAMW, {"F7"}, r"never changed", None),
  "optimizer on every micro-step, warmup-cosine to 0 in 3 updates": (
    optimizer_on_every_micro_step,
    WARMUP_COSINE_TO_0,
    {"F3"},
    r"learning rate is 0 at update 1 \(whole batch: 0.001\).*: none of the 5 "
    r"updates your loop applies moves the params",
    _applies_every_update_but_lr_is_0,
  ),
  "scheduler on every micro-step and step % k == 0, warmup-cosine to 0": (
    pytorch_loop,
    WARMUP_COSINE_TO_0,
    {"F3", "F4"},
    r"learning rate is 0 at update 1 .* zero updates from micro-step 5: 5 of the "
    r"6 updates your loop applies move nothing",
    _f4_names_where_updates_land,
  ),
  "empties its sum during warmup only: wrong from update 4": (
    empties_only_in_warmup,
    ADAMW,
    {"other"},
    r"off after update 4 ",
    _compares_after_the_restart,
  ),
  "schedule chained after optax_accum.MultiSteps": (
    None,
    optax.chain(
      optax_accum.MultiSteps(ADAMW, K).gradient_transformation(),
      optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 6)),
    ),
    {"F3"},
    r"step count of \[1\], chained after the accumulator, is 12 after 3 updates "
    r"\(whole batch: 3\)",
    _chained_layout_is_audited_as_written,
  ),
}


@pytest.mark.parametrize("name", CORPUS)
def test_corpus_of_seed_bugs_gets_the_exact_verdict(name):
  setup, optimizer, found, pattern, check = CORPUS[name]
  report = _audit(setup, optimizer)
  assert report.found() == found, str(report)
  assert not report.ok
  first = sorted(found)[0]
  assert re.search(pattern, report.verdicts[first].detail), str(report)
  for failure in found:
    assert report.verdicts[failure].fix, str(report)
  if check:
    check(report)


def test_accumulator_misuse_is_refused_with_the_right_call():
  params, batch = init_params(), make_batch()
  with pytest.raises(ValueError, match=r"`k`=2 but the optax.MultiSteps .* pass k=4"):
    optax_accum.audit(mean_loss, optax.MultiSteps(ADAMW, K), params, batch, k=2)
  with pytest.raises(
    ValueError, match=r"inner optimizer \(`optimizer=acc.inner_opt`\)"
  ):
    optax_accum.audit(
      mean_loss,
      optax.MultiSteps(ADAMW, K).gradient_transformation(),
      params,
      batch,
      k=K,
      accumulation=optax_multisteps_loop,
    )


def test_optax_multisteps_inside_a_chain_is_refused_with_how_to_pass_it():
  """The chained layout works with optax_accum.MultiSteps (the corpus audits it);
  optax.MultiSteps cannot end a window on demand, so the message says what to do."""
  chained = optax.chain(
    optax.MultiSteps(ADAMW, K).gradient_transformation(),
    optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 6)),
  )
  with pytest.raises(
    ValueError,
    match=r"holds an optax.MultiSteps inside another transformation.*put "
    r"optax_accum.MultiSteps\(opt, k\) in its place",
  ):
    optax_accum.audit(mean_loss, chained, init_params(), make_batch(), k=K)


# --- correct setups: OK ----------------------------------------------------------


def _restart_where_lr_is_0(report):
  """Whole-batch params stop at update 4: the restart still sees updates applied."""
  assert report.lr_reference[""] == pytest.approx([1e-3, 1e-2, 5e-3, 0, 0], abs=1e-9)
  assert report.expected_resumed[1:] == [False] * (2 * K)  # Nothing moves...
  assert report.applied_resumed == report.expected_applied_resumed
  assert any(report.applied_resumed[1:])  # ...but the loop applies its updates.


# name: (accumulation, optimizer, loss_fn[, further checks]).
CORRECT = {
  "optax_accum (default)": (None, ADAMW, mean_loss),
  "optax_accum (default), warmup-cosine to 0 in 3 updates": (
    None,
    WARMUP_COSINE_TO_0,
    mean_loss,
    _restart_where_lr_is_0,
  ),
  "optax_accum, three groups": (None, GROUPS_PLAIN, mean_loss),
  "optax_accum.MultiSteps passed as the optimizer, linear to 0 at update 5": (
    None,
    optax_accum.MultiSteps(LINEAR_TO_0, K),
    mean_loss,
  ),
  "the grad_reduction='sum' recipe: a summed loss": (
    None,
    optax_accum.MultiSteps(ADAMW, K, grad_reduction="sum"),
    summed_loss,
  ),
  "a correct hand loop": (correct_hand_loop, ADAMW, mean_loss),
  "a correct hand loop, warmup-cosine to 0 in 3 updates": (
    correct_hand_loop,
    WARMUP_COSINE_TO_0,
    mean_loss,
  ),
  "a correct hand loop that reads .hyperparams": (
    hand_loop_logging_lr,
    ADAMW,
    mean_loss,
  ),
  "a correct hand loop with a Python counter": (
    correct_hand_loop_python_counter,
    ADAMW_PLAIN,
    mean_loss,
  ),
  "optax.MultiSteps on equal lengths": (optax_multisteps_loop, ADAMW, mean_loss),
}


@pytest.mark.parametrize("name", CORRECT)
def test_correct_setups_are_ok(name):
  setup, optimizer, loss_fn, *check = CORRECT[name]
  batch = make_batch()
  if "equal lengths" in name:
    batch["mask"] = np.ones_like(batch["mask"])  # F1 cannot show.
  report = _audit(setup, optimizer, loss_fn, batch=batch)
  assert report.ok and report.found() == set(), str(report)
  assert report.grad_error < 1e-5
  assert report.rounding_leaves == ["['attn']['k']['b']"]
  assert report.params_diff > report.tolerance  # The key bias differs, as it may.
  assert report.changed == report.expected_changes
  assert report.verdicts["F7"].status == "ok"  # The restart was tested...
  if "Python counter" in name:  # ...and shifts this loop's windows by one.
    assert report.updates_compared == 3
    assert "one micro-step late: updates 4-5 not compared" in str(report)
  else:
    assert report.updates_compared == 5
    assert report.resumed == report.expected_resumed
  assert (len(set(report.tokens)) > 1) == ("equal lengths" not in name)
  for further in check:
    further(report)


def test_the_docs_list_every_setup_of_the_corpus():
  page = (pathlib.Path(__file__).parent.parent / "docs" / "audit.md").read_text()
  table = page.split("## The audit's own test corpus", 1)[1]
  for name in [*CORPUS, *CORRECT]:
    assert f"\n| {name} | " in table, name


class NNXModel(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(V, D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads=2, in_features=D, decode=False, rngs=rngs
    )
    self.head = nnx.Linear(D, V, rngs=rngs)

  def __call__(self, inputs):
    h = self.embed(inputs)
    h = h + self.attn(h, mask=nnx.make_causal_mask(inputs))
    return self.head(jnp.tanh(h))


def test_nnx_optimizer_with_attention_is_ok():
  graphdef, params = nnx.split(NNXModel(nnx.Rngs(0)), nnx.Param)

  def loss_fn(params, batch):
    return _token_mean_ce(nnx.merge(graphdef, params)(batch["inputs"]), batch)

  @nnx.jit
  def micro_step(model, opt, batch):
    def loss(model):
      return _token_mean_ce(model(batch["inputs"]), batch)

    grads, n = nnx.grad(loss, has_aux=True)(model)
    opt.update(model, grads, weight=n)

  def nnx_optimizer(optimizer, k):
    """The nnx way: nnx.Optimizer around optax_accum.MultiSteps, weight passed."""

    def init(params):
      model = nnx.merge(graphdef, params)
      return nnx.Optimizer(model, optax_accum.MultiSteps(optimizer, k), wrt=nnx.Param)

    def step(params, opt, micro_batch):
      model = nnx.merge(graphdef, params)
      micro_step(model, opt, micro_batch)
      return nnx.state(model, nnx.Param), opt

    return init, step

  report = optax_accum.audit(
    loss_fn, ADAMW, params, make_batch(), k=K, accumulation=nnx_optimizer
  )
  assert report.ok, str(report)
  assert report.rounding_leaves == ["['attn']['key']['bias']"]
  assert report.lr[""] == pytest.approx(report.lr_reference[""])


class LinenModel(nn.Module):
  @nn.compact
  def __call__(self, inputs):
    h = nn.Embed(V, D)(inputs)
    h = h + nn.MultiHeadDotProductAttention(num_heads=2)(
      h, mask=nn.make_causal_mask(inputs)
    )
    return nn.Dense(V)(jnp.tanh(h))


def test_linen_with_make_train_step_is_ok():
  model = LinenModel()
  batch = make_batch()
  params = model.init(jax.random.key(0), batch["inputs"])["params"]

  def loss_fn(params, batch):
    return _token_mean_ce(model.apply({"params": params}, batch["inputs"]), batch)

  report = optax_accum.audit(loss_fn, ADAMW_PLAIN, params, batch, k=K)
  assert report.ok, str(report)
  assert any("['key']['bias']" in leaf for leaf in report.rounding_leaves)


def test_equinox_with_attention_is_ok():
  eqx = pytest.importorskip("equinox")
  keys = jax.random.split(jax.random.key(0), 3)

  class EqxModel(eqx.Module):
    embed: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    head: eqx.nn.Linear

    def __call__(self, inputs):  # One sequence.
      h = jax.vmap(self.embed)(inputs)
      h = h + self.attn(h, h, h, mask=jnp.tril(jnp.ones((T, T), bool)))
      return jax.vmap(self.head)(jnp.tanh(h))

  model = EqxModel(
    eqx.nn.Embedding(V, D, key=keys[0]),
    eqx.nn.MultiheadAttention(
      2,
      D,
      use_query_bias=True,
      use_key_bias=True,
      use_value_bias=True,
      use_output_bias=True,
      key=keys[1],
    ),
    eqx.nn.Linear(D, V, key=keys[2]),
  )
  params, static = eqx.partition(model, eqx.is_inexact_array)

  def loss_fn(params, batch):
    model = eqx.combine(params, static)
    return _token_mean_ce(jax.vmap(model)(batch["inputs"]), batch)

  @functools.cache
  def equinox_loop(optimizer, k):
    ms = optax_accum.MultiSteps(optimizer, k)

    @eqx.filter_jit
    def step(params, state, micro_batch):
      grads, n = jax.grad(loss_fn, has_aux=True)(params, micro_batch)
      updates, state = ms.update(grads, state, params, weight=n)
      return eqx.apply_updates(params, updates), state

    return ms.init, step

  report = optax_accum.audit(
    loss_fn, ADAMW, params, make_batch(), k=K, accumulation=equinox_loop
  )
  assert report.ok, str(report)
  assert any("key_proj.bias" in leaf for leaf in report.rounding_leaves)


def test_summed_window_gradient_is_reported_with_its_scale():
  """optax.MultiSteps(use_grad_mean=False) on equal lengths: k times the gradient."""
  batch = make_batch()
  batch["mask"] = np.ones_like(batch["mask"])
  report = _audit(summing_multisteps_loop, batch=batch)
  assert report.found() == {"other"}, str(report)
  assert report.grad_scale == pytest.approx(K, rel=1e-4)
  assert "the whole batch's gradient 4 times" in report.verdicts["other"].detail
  assert report.verdicts["F1"].status == "n/a"


def test_a_micro_batch_of_padding_is_not_reported_as_dropped():
  """optax.MultiSteps with micro-batch 3 all padding: its gradient is 0, so no
  coefficient can show it missing; the mean of micro-batch means is F1."""
  batch = make_batch()
  batch["mask"][2::K] = False
  report = _audit(optax_multisteps_loop, batch=batch)
  assert report.tokens[2] == 0
  assert report.found() == {"F1"}, str(report)
  assert report.verdicts["F6"].status == "ok"


# --- the optimizer itself, and odd inputs ------------------------------------------


def test_an_optimizer_that_diverges_on_the_whole_batch_is_named():
  """bf16 Adam: b2=0.999 rounds to 1.0, so the whole batch diverges too."""
  bf16_adam = optax.inject_hyperparams(optax.adam, hyperparam_dtype=jnp.bfloat16)(
    learning_rate=1e-2, b2=0.999
  )
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), init_params())
  report = _audit(correct_hand_loop, bf16_adam, params=params, steps=2)
  assert report.found() == {"other"}, str(report)
  other = report.verdicts["other"]
  assert "the whole-batch run diverges too" in other.detail
  assert "b2 = 1" in other.detail and "make_train_step" not in other.fix


def test_a_reference_that_never_moves_is_never_ok():
  frozen = optax.inject_hyperparams(optax.sgd)(learning_rate=0.0)
  report = _audit(optax_multisteps_loop, frozen, steps=1)
  assert report.found() == {"F1", "other"}, str(report)  # F1: from the sgd probe.
  assert "never changed the params" in report.verdicts["other"].detail


def test_no_false_alarm_on_ordinary_inputs():
  """Warmup from lr 0, bf16 params, a tuple batch, aux outputs, a donating step."""
  warmup = optax.inject_hyperparams(optax.sgd)(
    learning_rate=optax.warmup_cosine_decay_schedule(0.0, 0.5, 1, 4), momentum=0.9
  )
  names = ("inputs", "targets", "mask")

  def tuple_loss(params, batch):
    loss, weight = toy_lm.mean_loss(params, dict(zip(names, batch, strict=True)))
    return loss, (weight, {"tokens": weight})

  data = toy_lm.make_batch(seed=0)
  bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), toy_lm.init_params(seed=0))
  report = optax_accum.audit(
    tuple_loss,
    warmup,
    bf16,
    tuple(data[n] for n in names),
    k=K,
    steps=2,
    has_aux=True,
  )
  assert report.ok, str(report)
  assert report.grad_error < 1e-5  # Measured on float32 copies.
  assert report.expected_changes[K - 1] is False  # lr 0 at the first update.
  assert not any(x.is_deleted() for x in jax.tree.leaves(bf16))


def test_non_finite_params_are_reported():
  def exploding(optimizer, k):
    init, step = optax_multisteps_loop(optimizer, k)  # Compiled already.

    def nan_step(params, state, micro_batch):
      params, state = step(params, state, micro_batch)
      return jax.tree.map(lambda p: p * jnp.nan, params), state

    return init, nan_step

  report = _audit(exploding)
  assert report.found() == {"other"}, str(report)
  assert "non-finite after micro-step 1" in report.verdicts["other"].detail


# --- errors ----------------------------------------------------------------------


def test_argument_errors():
  with pytest.raises(ValueError, match=r"`k` must be an int >= 1, got 0"):
    optax_accum.audit(mean_loss, optax.sgd(0.1), {}, {}, k=0)
  with pytest.raises(ValueError, match=r"`batch` holds 2 batches for steps=3"):
    optax_accum.audit(mean_loss, optax.sgd(0.1), {}, [{}, {}], k=2)


def test_a_loss_without_weight_is_a_clear_error():
  def scalar_loss(params, batch):
    return mean_loss(params, batch)[0]

  with pytest.raises(
    ValueError,
    match=r"`loss_fn` must return \(loss, weight\) with has_aux=False, got one array "
    r"of shape \(\)",
  ):
    optax_accum.audit(scalar_loss, ADAMW, init_params(), make_batch(), k=K)
  with pytest.raises(ValueError, match=r"got \(loss, dict\): set has_aux=True\?"):
    optax_accum.audit(
      lambda p, b: (mean_loss(p, b)[0], {"n": 1.0}),
      ADAMW,
      init_params(),
      make_batch(),
      k=K,
    )


def test_make_train_step_names_the_module_of_a_wrong_optimizer():
  with pytest.raises(ValueError, match=r"got optax\.MultiSteps"):
    optax_accum.make_train_step(mean_loss, optax.MultiSteps(ADAMW, K))


# --- a trainer that takes whole windows (issue 49, item 6) -------------------------


def _window_trainer(weighted):
  """xlstm-jax's shape: one jitted call per window, over its micro-batches;
  `weighted=False` is its original uniform mean of micro-batch gradients."""

  def setup(optimizer, k):
    @jax.jit
    def train_window(params, state, micro_batches):
      grads, weights = zip(*(_grads(params, b) for b in micro_batches), strict=True)
      shares = weights if weighted else (1.0,) * k
      total = sum(shares)
      mean = jax.tree.map(
        lambda *g: sum(s * x for s, x in zip(shares, g, strict=True)) / total, *grads
      )
      updates, state = optimizer.update(mean, state, params)
      return optax.apply_updates(params, updates), state

    return optimizer.init, train_window

  return setup


@pytest.mark.parametrize(  # OK in CI too: per_window's doctest.
  "weighted",
  [True, False],
  ids=["token_weighted", "uniform"],
)
def test_a_window_level_trainer_through_per_window(weighted):
  report = _audit(optax_accum.per_window(_window_trainer(weighted)), ADAMW_PLAIN)
  assert report.ok == weighted
  assert sorted(report.found()) == ([] if weighted else ["F1"])


def test_the_library_step_in_your_own_jit_is_audited():
  """The audit builds its programs with quick XLA options, which JAX takes on a
  top-level jit only: a step built in the setup and traced in the setup's own
  jit runs as that program's part (it failed: options on a nested jit)."""

  def in_your_jit(optimizer, k):
    step = optax_accum.make_train_step(mean_loss, optax_accum.MultiSteps(optimizer, k))
    run = jax.jit(lambda p, s, b: step(p, s, b)[:2])
    return step.init, run

  report = _audit(in_your_jit, ADAMW_PLAIN)
  assert report.ok, str(report)
