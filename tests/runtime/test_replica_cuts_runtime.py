"""A cut between data-parallel stages sent per replica pair (``harpjax.runtime.rows``): the
pieces are the ``lcm(dp_p, dp_c)`` row blocks, they move device to device without gathering
the value, and training across such cuts (``dp_p != dp_c``) equals ``jax.jit`` in float64."""

import dataclasses
import math

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import harpjax
from harpjax.runtime import rows
from tests import zoo
from tests.equivalence import DEMO_CLUSTER, max_rel_err

RTOL = 1e-10


def _mesh(devices, dp, tp):
  return Mesh(np.asarray(devices).reshape(dp, tp), ("dp", "tp"))


@pytest.mark.parametrize("dp_p,dp_c", [(1, 1), (2, 4), (4, 2), (3, 2), (2, 3), (4, 6), (1, 3)])
def test_pieces_are_the_lcm_row_blocks(dp_p, dp_c):
  n = 24
  pieces = rows.replica_pieces(n, rows.equal_ranges(n, dp_p), rows.equal_ranges(n, dp_c))
  assert len(pieces) == dp_p + dp_c - math.gcd(dp_p, dp_c)
  block = n // math.lcm(dp_p, dp_c)
  covered = []
  for pc in pieces:
    assert pc.rows % block == 0
    assert pc.start // (n // dp_p) == pc.src and (pc.stop - 1) // (n // dp_p) == pc.src
    assert pc.start // (n // dp_c) == pc.dst and (pc.stop - 1) // (n // dp_c) == pc.dst
    covered += range(pc.start, pc.stop)
  assert sorted(covered) == list(range(n))


def test_pieces_refuse_ranges_that_do_not_tile():
  with pytest.raises(ValueError, match="do not tile"):
    rows.replica_pieces(8, [(0, 4), (5, 8)], [(0, 8)])
  with pytest.raises(ValueError, match="do not tile"):
    rows.replica_pieces(8, [(0, 8)], [(0, 4)])


CUTS = [  # (producer devices, dp, tp), (consumer devices, dp, tp)
    ((range(0, 2), 2, 1), (range(2, 6), 4, 1)),
    ((range(0, 4), 4, 1), (range(4, 6), 2, 1)),
    ((range(0, 3), 3, 1), (range(3, 7), 2, 2)),
    ((range(0, 4), 2, 2), (range(4, 7), 3, 1)),
    ((range(0, 2), 2, 1), (range(2, 3), 1, 1)),
    ((range(0, 1), 1, 1), (range(1, 4), 3, 1)),
]


@pytest.mark.parametrize("src,dst", CUTS)
def test_move_rows_sends_each_piece_device_to_device(src, dst, monkeypatch):
  devs = jax.devices()
  sp = NamedSharding(_mesh([devs[i] for i in src[0]], src[1], src[2]), P("dp"))
  sc = NamedSharding(_mesh([devs[i] for i in dst[0]], dst[1], dst[2]), P("dp"))
  x = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
  a = jax.device_put(x, sp)
  calls = []
  real = jax.device_put

  def spy(v, where=None, **kw):
    calls.append((v, where))
    return real(v, where, **kw)

  monkeypatch.setattr(jax, "device_put", spy)
  b = rows.move_rows(a, sc)
  monkeypatch.undo()
  assert b.sharding == sc
  np.testing.assert_array_equal(np.asarray(b), x)
  # Every move is one device's array to one device (the old path device_put the whole value
  # into the consumer's sharding, through host memory where the rows differ).
  for v, where in calls:
    assert isinstance(v, jax.Array) and len(v.devices()) == 1, v
    assert isinstance(where, jax.Device), where
  src_devs = {devs[i] for i in src[0]}
  cross = [(v, w) for v, w in calls if next(iter(v.devices())) in src_devs]
  dp_p, dp_c = src[1], dst[1]
  assert len(cross) == dp_p + dp_c - math.gcd(dp_p, dp_c)
  assert sum(v.shape[0] for v, _ in cross) == 24   # each row crosses the cut once
  # Inside the consumer: the joined rows go to each replica's other (tensor-parallel) devices.
  assert len(calls) - len(cross) == dp_c * (dst[2] - 1)


def test_move_rows_keeps_device_put_where_rows_do_not_apply():
  devs = jax.devices()
  sp = NamedSharding(_mesh(devs[:2], 1, 2), P(None, "tp"))
  sc = NamedSharding(_mesh(devs[2:6], 4, 1), P("dp"))
  x = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
  b = rows.move_rows(jax.device_put(x, sp), sc)
  assert b.sharding == sc
  np.testing.assert_array_equal(np.asarray(b), x)
  assert rows.pieces_between(sp, sc, x.shape) is None
  scalar = jax.device_put(np.float32(3), NamedSharding(_mesh(devs[:2], 2, 1), P()))
  assert float(rows.move_rows(scalar, NamedSharding(_mesh(devs[2:4], 2, 1), P()))) == 3.0


# --------------------------------------------------------------------------- training


BATCH = 24   # 12 rows per microbatch: divisible by 2, 3 and 4 replicas


def _case():
  case = zoo.linen("loop")
  batches = [{"x": jax.random.normal(jax.random.key(20 + i), (BATCH, zoo.WIDTH), np.float64),
              "y": jax.random.randint(jax.random.key(30 + i), (BATCH,), 0, zoo.CLASSES),
              "rng": jax.random.key(40 + i)} for i in range(2)]
  return dataclasses.replace(case, batches=batches)


def _plan(num_layers, stages):
  half = num_layers // 2
  ranges = [(0, half - 1), (half, num_layers - 1)]
  return dataclasses.replace(harpjax.ManualPlan([
      dict(layers=r, subcluster=sc, submesh=sm, logical_mesh=lm, zero=z)
      for r, (sc, sm, lm, z) in zip(ranges, stages)]), layer_source="auto")


PLANS = {   # (subcluster, submesh, logical mesh, ZeRO level) of the two stages
    "dp2-dp4": [("v100", (1, 2), (2, 1), 0), ("a100", (2, 2), (4, 1), 0)],
    "dp4z3-dp2z2": [("v100", (1, 4), (4, 1), 3), ("a100", (1, 2), (2, 1), 2)],
    "dp3z1-dp2tp2": [("v100", (1, 3), (3, 1), 1), ("a100", (2, 2), (2, 2), 0)],
}
FAST = ("dp4z3-dp2z2",)   # the others with the slow cases


def _train_like_jit(name, monkeypatch, **kw):
  case = _case()
  moved = []
  real = rows.pieces_between

  def spy(src, dst, shape):
    out = real(src, dst, shape)
    if out is not None and out[1] != out[2]:
      moved.append((len(out[1]), len(out[2])))
    return out

  monkeypatch.setattr(rows, "pieces_between", spy)
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2)
  plan = _plan(len(probe.trace(case.state, case.batches[0]).layers), PLANS[name])
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2, plan=plan,
                                **kw)
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for i, batch in enumerate(case.batches):
    out_ref, out_par = ref(s_ref, batch), pstep(s_par, batch)
    err = max_rel_err(out_ref, out_par)
    assert err <= RTOL, f"step {i}: {err:.3g}"
    s_ref, s_par = out_ref[0], out_par[0]
  return moved


@pytest.mark.parametrize("name", [n if n in FAST else pytest.param(n, marks=pytest.mark.slow)
                                  for n in PLANS])
def test_cut_between_different_dp_matches_jit_float64(x64, name, monkeypatch):
  moved = _train_like_jit(name, monkeypatch)
  dp = [lm[0] for _, _, lm, _ in PLANS[name]]
  # The activations went forward and their cotangents back per replica pair.
  assert (dp[0], dp[1]) in moved and (dp[1], dp[0]) in moved, moved


def _ray(monkeypatch=None):
  pytest.importorskip("ray")
  from harpjax.runtime import ray_runtime
  hosts = [h.name for h in harpjax.Cluster.load(DEMO_CLUSTER).hosts]
  ray_runtime.init_ray(num_cpus=2, resources={ray_runtime.HOST_RESOURCE_PREFIX + h: 100
                                               for h in hosts})
  return ray_runtime


def _trains_like_jit_on_ray(case, stages, ray_runtime):
  """The case planned as ``stages`` on Ray: every step's loss and the final state equal
  ``jax.jit``'s to :data:`RTOL`; returns the pipelined step."""
  probe = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2)
  plan = _plan(len(probe.trace(case.state, case.batches[0]).layers), stages)
  pstep = harpjax.auto_parallel(case.step, cluster=DEMO_CLUSTER, num_microbatches=2,
                                plan=plan, runtime="ray")
  ref = jax.jit(case.step)
  s_ref = s_par = case.state
  for i, batch in enumerate(case.batches):
    out_ref, out_par = ref(s_ref, batch), pstep(s_par, batch)
    assert max_rel_err(out_ref[1], out_par[1]) <= RTOL, i
    s_ref, s_par = out_ref[0], out_par[0]
  assert max_rel_err(s_ref, ray_runtime.gather(s_par)) <= RTOL
  return pstep


@pytest.mark.slow   # Ray start-up: about 50 s
@pytest.mark.filterwarnings("ignore:os.fork")
def test_cut_between_different_dp_on_ray_matches_jit_float64(x64):
  # Stage 0 (dp = 4, one V100 host) sends to stage 1 (dp = 2, one A100 host) over TCP: one
  # host on each side, so the cut is the one host-pair message cut_time_s prices with
  # hp = hc = 1; the A100 stage's devices each take their rows of it.
  ray_runtime = _ray()
  try:
    case = _case()
    pstep = _trains_like_jit_on_ray(case, [("v100", (1, 4), (4, 1), 0),
                                           ("a100", (1, 2), (2, 1), 2)], ray_runtime)
    runner = pstep.runner(case.state, case.batches[0])
    assert [r.transport for r in runner.routes.values()] == ["tcp", "tcp"]
    runner.shutdown()
  finally:
    ray_runtime.release_pool()
    import ray
    ray.shutdown()


@pytest.mark.parametrize("curve", [False, True])
def test_emulated_link_charges_the_one_host_pair_message_as_cut_time_s(curve):
  # A cut between two one-host stages is one host-pair message: the emulated link holds it for
  # what cut_time_s prices with hp = hc = 1 (the cost model's price of what runs), on a link
  # of one bandwidth and on one whose bandwidth depends on the message's size.
  from harpjax.cluster import BandwidthCurve, Link
  from harpjax.compiler.profile import cut_time_s
  from harpjax.runtime.emulation import Emulation
  c = BandwidthCurve.from_gbps([[1e5, 1.0], [1e7, 4.0], [1e9, 9.0]]) if curve else None
  link = Link(1.125e9, 5e-5, curve=c)
  emu = Emulation(fwd_s=(1.0, 1.0), bwd_s=(2.0, 2.0), links={(0, 1): link}, time_scale=0.5,
                  bytes_scale=3.0)
  for b in (1e4, 3e5, 2e7, 4e9):
    want = cut_time_s(b * 3.0, link.bandwidth_bytes_per_s, link.latency_s, c, 1, 1) * 0.5
    assert emu.transfer_s(0, 1, b) == pytest.approx(want, rel=1e-12)
    assert emu.delay_fn(0, 1)(b) == pytest.approx(want, rel=1e-12)
    assert emu.cut_transfer_s(0, 1, b) == pytest.approx(want, rel=1e-12)
    # Sent per host pair between stages over 2 and 4 hosts: each sending host's lane is held
    # for the cut's cut_time_s, 2 x 4 hosts' rows at once.
    for hp, hc in ((2, 4), (4, 2), (1, 2)):
      want = cut_time_s(b * 3.0, link.bandwidth_bytes_per_s, link.latency_s, c, hp, hc) * 0.5
      assert emu.cut_delay_fn(0, 1, hp, hc)(b) == pytest.approx(want, rel=1e-12)
  assert emu.cut_delay_fn(1, 0, 2, 2) is None   # no link given that way


@pytest.mark.slow   # Ray start-up and a group of two processes: about 40 s each
@pytest.mark.filterwarnings("ignore:os.fork")
@pytest.mark.parametrize("stages", [
    [("v100", (1, 4), (4, 1), 0), ("a100", (2, 2), (2, 2), 0)],
    [("v100", (1, 2), (2, 1), 1), ("a100", (2, 2), (4, 1), 2)],
], ids=["dp4-dp2tp2-over-two-hosts", "dp2z1-dp4z2-over-two-hosts"])
def test_cut_to_a_stage_over_two_hosts_goes_per_host_pair_float64(x64, stages):
  # Stage 1 spans the two A100 hosts (a group of two processes, each holding its rows): the
  # V100 stage sends each A100 host its rows on its own connection and each A100 host sends
  # its rows' cotangents back on its own, nothing gathered onto the group's leader; training
  # equals jax.jit in float64.
  ray_runtime = _ray()
  import ray
  try:
    case = _case()
    pstep = _trains_like_jit_on_ray(case, stages, ray_runtime)
    runner = pstep.runner(case.state, case.batches[0])
    members = runner._backend.actors[1]
    assert len(members) == 2
    # Each member of the group has its own connection to stage 0, and stage 0 one to each.
    conns = ray.get([m.__ray_call__.remote(
        lambda w: {t: sorted(x.channel.channels) for t, x in w.member_senders.items()})
        for m in members])
    assert conns == [{0: [0]}, {0: [0]}], conns
    v = ray.get(runner._backend.actors[0][0].__ray_call__.remote(
        lambda w: {t: sorted(x.channel.channels) for t, x in w.member_senders.items()}))
    assert v == {1: [0, 1]}, v
    # The activations left stage 0 as pieces (one message per microbatch, a piece to each
    # A100 host in it), none through the group's leader alone.
    acts = [(dst, type(k).__name__, k.rank) for dst, k, *_ in runner.last.sends[0]
            if k.kind == "act"]
    assert sorted(acts) == [(1, "PieceKey", 0)] * 2, acts
    runner.shutdown()
  finally:
    ray_runtime.release_pool()
    ray.shutdown()
