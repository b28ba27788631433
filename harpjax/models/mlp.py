"""Small MLPs that mark a layer cut after every hidden layer (tests and examples).

Ordinary Flax linen modules: outside :func:`harpjax.auto_parallel` the markers are the identity,
so the same code runs under plain ``jax.jit``.
"""

from __future__ import annotations

import flax.linen as nn

from harpjax.compiler.trace import mark_layer_boundary

__all__ = ["MLP", "DropoutMLP"]


class MLP(nn.Module):
  """A plain MLP with a cut after every hidden layer."""
  features: tuple = (32, 32, 32)
  num_classes: int = 10

  @nn.compact
  def __call__(self, x, train: bool = False):
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Dense(f, name=f"dense_{i}")(x))
      x = mark_layer_boundary(x)
    return nn.Dense(self.num_classes, name="head")(x)


class DropoutMLP(nn.Module):
  """An MLP with dropout in every layer (checks that random numbers match ``jax.jit``)."""
  features: tuple = (32, 32, 32)
  num_classes: int = 10
  rate: float = 0.2

  @nn.compact
  def __call__(self, x, train: bool = True):
    for i, f in enumerate(self.features):
      x = nn.relu(nn.Dense(f, name=f"dense_{i}")(x))
      x = nn.Dropout(self.rate, deterministic=not train)(x)
      x = mark_layer_boundary(x)
    return nn.Dense(self.num_classes, name="head")(x)
