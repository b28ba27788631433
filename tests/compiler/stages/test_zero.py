"""ZeRO's pieces without running a step: split specs, the plan field, and which step inputs
are optimizer state (found from the data flow, whatever the optimizer)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec as P

import harpjax
from harpjax.compiler.layers import sharding as S
from harpjax.compiler.plan import Plan, StageSpec
from harpjax.compiler.stages import state_successors
from harpjax.errors import PlanError
from tests import zoo
from tests.equivalence import DEMO_CLUSTER


def test_zero_spec_splits_the_largest_free_dividing_dimension():
  assert S.zero_spec((12, 32), P(), 2) == P(None, "dp")
  assert S.zero_spec((32, 12), P(), 4) == P("dp")
  assert S.zero_spec((12, 32), P(None, "tp"), 2, 2) == P("dp", "tp")   # 12 left whole
  assert S.zero_spec((5, 16), P(), 4) == P(None, "dp")
  assert S.zero_spec((16, 16), P(), 2) == P("dp")                       # the first of equals
  # Nothing whole divides: a tp-split dimension divisible by tp * dp splits on both.
  assert S.zero_spec((32,), P("tp"), 2, 2) == P(("tp", "dp"))
  # Nothing divides at all, a scalar, dp = 1, already split on dp: unchanged (replicated).
  assert S.zero_spec((3,), P(), 2) == P()
  assert S.zero_spec((6,), P("tp"), 4, 2) == P("tp")
  assert S.zero_spec((), P(), 2) == P()
  assert S.zero_spec((8, 8), P(), 1) == P()
  assert S.zero_spec((8, 8), P("dp"), 2) == P("dp")


def test_stage_zero_field_is_checked_and_old_plan_files_stay_valid():
  s = StageSpec((0, 1), "v100", (1, 2), (2, 1), zero=2)
  assert s.zero == 2 and StageSpec((0, 1), "v100", (1, 2)).zero == 0
  plan = Plan((s, StageSpec((2, 3), "a100", (1, 2))))
  data = plan.to_json()
  assert data["stages"][0]["zero"] == 2 and "zero" not in data["stages"][1]   # 0: as before
  assert Plan.from_json(data) == plan
  old = {"stages": [{"layers": [0, 3], "subcluster": "a100", "submesh": [1, 2]}]}
  assert Plan.from_json(old).stages[0].zero == 0
  for bad in (4, -1, 1.5, "2", True):
    with pytest.raises(PlanError, match="zero"):
      StageSpec((0, 1), "v100", (1, 2), zero=bad)
  with pytest.raises(PlanError, match=r"stages\[0\].*zero"):
    Plan.from_json({"stages": [{"layers": [0, 3], "subcluster": "a", "submesh": [1, 2],
                                "zero": 5}]})
  manual = harpjax.ManualPlan([dict(layers=(0, 1), subcluster="v100", submesh=(1, 2), zero=3)])
  assert manual.stages[0].zero == 3


def _named(tree):
  return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("tx, expected", [
    (optax.adamw(1e-2), {"mu", "nu"}),
    (optax.sgd(0.1, momentum=0.9), {"trace"}),
    (optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2)), {"mu", "nu"}),
    (optax.adafactor(1e-2, min_dim_size_to_factor=8), {"v_row", "v_col", "v"}),
], ids=["adamw", "momentum", "clip-adam", "adafactor"])
def test_optimizer_state_is_found_from_the_data_flow(x64, tx, expected):
  # The state input of (params, opt_state) -> (new params, new opt_state): every float leaf of
  # opt_state with a shape is optimizer state, whatever its name, and its successor is the same
  # leaf of the new opt_state; parameters map to the new parameters; counters (scalars,
  # integers) are not state. Adafactor's factored second moments have shapes no parameter has.
  case = zoo.linen("loop", tx)
  traced = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4).trace(
      case.state, case.batches[0]).step
  params, state = state_successors(traced)
  outer = traced.outer
  leaf_vids = outer.invars[outer.num_consts:]
  in_names = list(_named(case.state))
  out_names = list(_named(jax.eval_shape(case.step, case.state, case.batches[0])[0]))
  out_vid = {outer.outvars[i]: out_names[i] for i in range(len(out_names))}
  name_of = dict(zip(leaf_vids, in_names))
  assert {name_of[v] for v in params} == {n for n in in_names if n.startswith("[0]")}
  assert all(out_vid[nxt] == name_of[v] for v, nxt in params.items())
  found = {name_of[v] for v in state}
  floats = {"[1]" + n: x for n, x in _named(case.state[1]).items()
            if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim}
  # Adafactor keeps [1]-shaped placeholders it never updates (v of a factored kernel): not
  # state, and nothing to split anyway.
  assert {n for n, x in floats.items() if x.size > 1} <= found <= set(floats)
  assert {n.split(".", 1)[-1].split("[")[0] for n in found} == expected
  assert all(out_vid[nxt] == name_of[v] for v, nxt in state.items())


def test_mutable_collections_and_the_batch_are_not_optimizer_state(x64):
  # batch_stats flow into the region (the model reads them): not optimizer state, even though
  # the step returns their next value; the momentum buffers are.
  case = zoo.batch_stats()
  traced = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=4).trace(
      case.state, case.batches[0]).step
  _, state = state_successors(traced)
  outer = traced.outer
  names = dict(zip(outer.invars[outer.num_consts:], _named(case.state)))
  assert state and all(names[v].startswith("[2]") for v in state), [names[v] for v in state]
