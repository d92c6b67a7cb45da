"""No program of the train step does more work than the recorded figures, and
on the benchmark's LM the accumulate program no more than a hand-written call.

The figures (``tests/data/program_costs.json``) are XLA's FLOPs, bytes
accessed and scratch bytes of each program on the benchmark models, recorded
from a default build with ``python -m tests.program_costs`` (see its
docstring); deterministic for one jax version, and the HLO's: the same
without LLVM's passes, with XLA:CPU's elemental emitters and in one LLVM
module, as the suite compiles (tests/conftest.py).
"""

import json

import jax
import jax.numpy as jnp
import optax
import program_costs
import pytest

import optax_accum
from benchmarks.accumulation import causal_lm

#: Bytes a program may access beyond the record: 16 float32 scalars. The
#: layered programs access 12 to 28 bytes more than the recorded ones on three
#: of the six configurations (scalar selects placed differently; their FLOPs
#: are 4 to 6 lower), against 18 MB or more for the whole program.
SCALAR_BYTES = 64


def _recorded():
  return json.loads(program_costs.RECORD.read_text())


@pytest.mark.skipif(
  _recorded()["jax"] != jax.__version__,
  reason="figures recorded with another jax version: XLA's own figures differ",
)
@pytest.mark.slow
@pytest.mark.parametrize("config", program_costs.CONFIGS, ids=lambda c: str(c))
def test_programs_do_no_more_work_than_recorded(config):
  recorded = _recorded()["programs"][program_costs.key(*config)]
  measured = program_costs.program_costs(*config)
  assert measured.keys() == recorded.keys()
  for program, figures in recorded.items():
    for name, value in figures.items():
      slack = SCALAR_BYTES if name == "bytes accessed" else 0
      assert measured[program][name] <= value + slack, (program, name, measured)


#: The share of FLOPs and bytes the step's accumulate program may add to a
#: hand-written one on the LM.
LM_SLACK = 1.005


@pytest.mark.skipif(
  jax.default_backend() != "cpu",
  reason="XLA:CPU's figures: XLA:GPU counts its fusions' bytes otherwise (this "
  "bound failed on an H100, issue 49); benchmarks/accelerator.py times the GPU",
)
def test_lm_accumulate_program_does_the_hand_written_calls_work():
  """Issue 29: on the benchmark's LM a streamed micro-step costs what the
  token-weighted accumulate call a user would write costs (gradient, one
  weighted add into the donated sums), so the stream / floor ratio measures
  noise and dispatch, not extra work. Two of the LM's 12 blocks, the same
  width and batch: the programs repeat per block, and both sides compile
  alike (XLA's figures are the HLO's, the same without LLVM's passes)."""
  model = causal_lm(2, 64, 4, 32, 8)
  loss_fn, params = model["loss_fn"], model["params"]
  batch = jax.device_put(model["batch"](model["rows"]))

  def accumulate(sums, params, batch):
    (loss, weight), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    return jax.tree.map(lambda s, g: s + weight * g, sums, grads), loss

  zeros = jax.tree.map(jnp.zeros_like, params)
  hand = jax.jit(accumulate, donate_argnums=0).lower(zeros, params, batch)
  opt = optax_accum.MultiSteps(optax.adamw(1e-4), program_costs.K)
  step = optax_accum.make_train_step(loss_fn, opt)
  ours = step.lower(params, opt.init(params), batch, program="accumulate")
  hand_figures = program_costs.figures(hand)
  our_figures = program_costs.figures(ours)
  for name in ("flops", "bytes accessed"):
    assert our_figures[name] <= LM_SLACK * hand_figures[name], (name, our_figures)
