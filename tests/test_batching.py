"""`split_micro_batches`: every leaf split alike, or an error naming the leaf."""

import numpy as np
import pytest

import optax_accum


def test_leaves_with_different_batch_sizes_are_refused():
  """Issue 43, item 6: 8 rows of inputs and 4 of labels would split into
  micro-batches whose rows do not belong together (micro-batch 0 would take
  inputs 0 and 4 but labels 0 only); the error names both leaves and sizes."""
  batch = {"x": np.zeros((8, 3)), "labels": {"y": np.zeros(4)}}
  with pytest.raises(
    ValueError,
    match=r"`batch` leaves disagree on the batch size \(leading axis\): "
    r"\['labels'\]\['y'\] has 4 rows, \['x'\] has 8\.",
  ):
    optax_accum.split_micro_batches(batch, 4)


def test_leaves_of_one_batch_size_split_alike():
  batch = {"x": np.arange(8).reshape(8, 1), "y": np.arange(8)}
  split = optax_accum.split_micro_batches(batch, 4)
  np.testing.assert_array_equal(split["x"][..., 0], split["y"])
  np.testing.assert_array_equal(split["y"][1], [1, 5])
