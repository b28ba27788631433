"""The GPT train step several benchmarks run: next-token cross-entropy, AdamW."""

from __future__ import annotations

import jax
import optax
from flax.training import train_state

import harpjax
from harpjax.models import GPT, GPTConfig


def lm_train_step(cfg: GPTConfig, batch: int, lr: float = 1e-3):
  """``(step, state, tokens)``: ``step(state, tokens) -> (state, loss)`` on ``tokens`` of
  shape ``(batch, seq_len + 1)`` (inputs are the first ``seq_len``, labels the last)."""
  model = GPT(cfg)
  tokens = jax.random.randint(jax.random.key(0), (batch, cfg.seq_len + 1), 0, cfg.vocab_size)
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(1), tokens[:, :-1]),
                                        tx=optax.adamw(lr))

  def step(state, batch):
    def loss_fn(p):
      logits = state.apply_fn(p, batch[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  return step, state, tokens
