"""NIC choice, channels, sender threads; and, where permitted, bytes over real interfaces."""

import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import harpjax
from harpjax.cluster import NIC, Cluster, LinkOverride, SubCluster
from harpjax.errors import ClusterSpecError, RuntimeFailure
from harpjax.models import MLP
from harpjax.runtime import transport
from harpjax.runtime.runner import PipelineRunner, RunnerOptions, ThreadBackend
from harpjax.runtime.channels import LocalChannel, Mailbox, Sender, TcpChannel, TcpListener
from harpjax.runtime.interpreter import MessageKey
from harpjax.runtime.transport import nccl_env, plan_routes
from tests.equivalence import max_rel_err

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def _two_subclusters():
  # RDMA fabric inside each subcluster, one Ethernet network across.
  return Cluster.simple([("a100", "A100-40G", 2, 2), ("v100", "V100-32G", 2, 2)],
                        inter_gbps=10, intra_gbps=200)


ADDRESSES = {"a100-0": {"ib0": "10.1.0.1", "eth0": "192.168.0.1"},
             "a100-1": {"ib0": "10.1.0.2", "eth0": "192.168.0.2"},
             "v100-0": {"ib0": "10.2.0.1", "eth0": "192.168.0.3"},
             "v100-1": {"ib0": "10.2.0.2", "eth0": "192.168.0.4"}}


def test_fabric_inside_a_subcluster_and_ethernet_across():
  cluster = _two_subclusters()
  hosts = ["a100-0", "a100-1", "v100-0", "v100-1"]
  pairs = [(0, 1), (1, 2), (2, 3), (3, 2), (2, 1), (1, 0)]
  routes = plan_routes(cluster, hosts, pairs,
                       addresses=transport.normalize_addresses(ADDRESSES))
  inside = routes[(0, 1)]
  assert (inside.src_nic, inside.dst_nic, inside.link.kind) == ("ib0", "ib0", "rdma")
  assert (inside.transport, inside.src_address, inside.dst_address) == \
      ("tcp", "10.1.0.1", "10.1.0.2")
  across = routes[(1, 2)]
  assert (across.src_nic, across.link.kind, across.link.gbps) == ("eth0", "ethernet", 10)
  assert (across.src_address, across.dst_address) == ("192.168.0.2", "192.168.0.3")
  assert routes[(2, 3)].src_address == "10.2.0.1" and routes[(2, 3)].link.kind == "rdma"
  assert routes[(2, 1)].src_address == "192.168.0.3"
  # Two stages on one host use loopback; on one machine loopback stands for every NIC.
  same = plan_routes(cluster, ["a100-0", "a100-0"], [(0, 1)])[(0, 1)]
  assert (same.transport, same.src_address, same.link.kind) == ("tcp", "127.0.0.1", "intra_host")
  local = plan_routes(cluster, hosts, [(1, 2)], single_machine=True)[(1, 2)]
  assert (local.src_nic, local.src_address) == ("eth0", "127.0.0.1")


def test_unknown_addresses_fall_back_to_the_object_store():
  cluster = _two_subclusters()
  hosts = ["a100-0", "v100-0"]
  r = plan_routes(cluster, hosts, [(0, 1)])[(0, 1)]
  assert r.transport == "object_store" and r.src_nic == "eth0" and "no address" in r.reason
  with pytest.raises(ClusterSpecError, match="no address for NIC eth0 of a100-0"):
    plan_routes(cluster, hosts, [(0, 1)], transport="tcp")
  forced = plan_routes(cluster, hosts, [(0, 1)], transport="object_store",
                       addresses=transport.normalize_addresses(ADDRESSES))[(0, 1)]
  assert forced.transport == "object_store"
  # A link override between subclusters that share no network has no NIC pair.
  a = SubCluster("a", "A100-40G", 1, 1, nics=(NIC("ib0", "rdma", 100, "fab-a"),))
  b = SubCluster("b", "V100-32G", 1, 1, nics=(NIC("ib0", "rdma", 100, "fab-b"),))
  c = Cluster((a, b), links=(LinkOverride(("a", "b"), 1.0),))
  r = plan_routes(c, ["a-0", "b-0"], [(0, 1)])[(0, 1)]
  assert r.transport == "object_store" and "override without a NIC pair" in r.reason


def test_nic_address_forms():
  want = {("h", "eth0"): "1.2.3.4"}
  for form in ({"h": {"eth0": "1.2.3.4"}}, {("h", "eth0"): "1.2.3.4"}, {"h/eth0": "1.2.3.4"}):
    assert transport.normalize_addresses(form) == want
  with pytest.raises(ClusterSpecError):
    transport.normalize_addresses({"h": "1.2.3.4"})
  assert "lo" in transport.interface_addresses()


def test_nccl_env_follows_the_chosen_nic():
  cluster = _two_subclusters()
  fabric = cluster.link_between_hosts("a100-0", "a100-1")
  assert nccl_env(fabric, hca="mlx5_0", bootstrap_nic="eth0") == {
      "NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5_0", "NCCL_SOCKET_IFNAME": "eth0"}
  ethernet = cluster.link_between_hosts("a100-0", "v100-0")
  assert nccl_env(ethernet) == {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "eth0"}
  assert nccl_env(cluster.link_between_hosts("a100-0", "a100-0")) == {}


def test_tcp_channel_round_trip_and_token():
  box = Mailbox(1)
  listener = TcpListener("127.0.0.1", box, token="secret")
  ch = TcpChannel("127.0.0.1", listener.endpoint, "secret", src_stage=0)
  big = np.arange(300_000, dtype=np.float32).reshape(600, 500)
  key = jax.random.key(7)
  snd = Sender(ch, 0, 1)
  snd.submit(3, MessageKey("act", 0, 0), {5: jnp.asarray(big), 6: key, 7: np.int32(4)})
  snd.submit(3, MessageKey("act", 1, 0), {5: jnp.ones(3)})
  snd.flush(10)
  got = box.get((3, MessageKey("act", 0, 0)), 0, 10, "activations")
  np.testing.assert_array_equal(got[5], big)
  assert jax.random.key_impl(got[6]) == jax.random.key_impl(key)
  np.testing.assert_array_equal(jax.random.key_data(got[6]), jax.random.key_data(key))
  assert int(got[7]) == 4
  np.testing.assert_array_equal(box.get((3, MessageKey("act", 1, 0)), 0, 10, "x")[5],
                                np.ones(3))
  assert listener.bytes_received >= big.nbytes
  # A connection without the token is refused; messages do not arrive.
  bad = TcpChannel("127.0.0.1", listener.endpoint, "wrong", src_stage=2)
  try:
    bad.send(3, MessageKey("value", 1), 2, {1: ("a", np.ones(2))})
  except OSError:
    pass
  with pytest.raises(RuntimeFailure, match="stage 1: .* value from stage 2"):
    box.get((3, MessageKey("value", 1)), 2, 0.5, "value")
  # Closing the connection fails waits on that sender at once, naming it.
  snd.close()
  t0 = time.time()
  with pytest.raises(RuntimeFailure, match="lost stage 0"):
    box.get((4, MessageKey("act", 0, 0)), 0, 120, "activations")
  assert time.time() - t0 < 60   # at once, not at the 120 s timeout
  listener.close()


def test_mailbox_timeout_and_abort_name_the_stages():
  box = Mailbox(2)
  t0 = time.time()
  with pytest.raises(RuntimeFailure, match=r"stage 2: waited 0.3 s for the cotangents .* "
                                           r"from stage 3"):
    box.get((1, MessageKey("ct", 0, 3)), 3, 0.3, "the cotangents of microbatch 0")
  assert time.time() - t0 < 30   # at its timeout, not later (generous for a loaded machine)
  threading.Timer(0.2, box.fail, args=("stage 0 failed",)).start()
  with pytest.raises(RuntimeFailure, match="aborted .* stage 0 failed"):
    box.get((1, MessageKey("act", 0, 1)), 1, 30, "the activations")


def test_sender_is_fifo_per_direction_and_full_duplex():
  a, b = Mailbox(0), Mailbox(1)
  delay = lambda nbytes: 0.25 + nbytes / 1e6      # 250 ms + 1 MB/s
  ab, ba = Sender(LocalChannel(b), 0, 1, delay), Sender(LocalChannel(a), 1, 0, delay)
  t0 = time.time()
  for m in range(3):
    ab.submit(0, MessageKey("act", m, 0), {1: np.zeros(2500, np.float32)})   # 10 kB: 260 ms
    ba.submit(0, MessageKey("ct", m, 1), {1: np.zeros(2500, np.float32)})
  arrivals = []
  for m in range(3):
    b.get((0, MessageKey("act", m, 0)), 0, 30, "act")
    arrivals.append(time.time() - t0)
    a.get((0, MessageKey("ct", m, 1)), 1, 30, "ct")
  ab.flush(30)
  ba.flush(30)
  # One at a time per direction, in order, each occupying the direction for its delay (the
  # emulated link: message k starts when k-1's window ends, ``start_k >= start_{k-1} +
  # delay``); both directions at once: the reverse direction's first message starts inside the
  # forward one's window, not after it. Read from the senders' own records of their windows'
  # starts, so a loaded machine only makes the handing-over later, never the order wrong.
  d = delay(10_000)
  for sender in (ab, ba):
    ev = sender.events   # (step, key, start, end, nbytes)
    assert [e[1].index for e in ev] == [0, 1, 2], ev
    assert all(e[3] - e[2] >= d - 1e-6 for e in ev), ev
    assert all(b[2] >= a[2] + d - 1e-6 for a, b in zip(ev, ev[1:])), ev   # no overlap
  assert ba.events[0][2] < ab.events[0][2] + d and ab.events[0][2] < ba.events[0][2] + d
  assert arrivals == sorted(arrivals)


# --------------------------------------------------------------------------- real interfaces

NS = f"harpjax-t{os.getpid()}"
VETH = {"fabric": ("hjf", "10.231.1.1", "10.231.1.2"), "ether": ("hje", "10.231.2.1", "10.231.2.2")}


def _ip(*args, ns=None, check=True):
  cmd = (["ip", "netns", "exec", ns] if ns else []) + ["ip"] + list(args)
  return subprocess.run(cmd, check=check, capture_output=True, text=True)


@pytest.fixture(scope="module")
def netns():
  """A network namespace reached by two veth pairs: a 'fabric' and an 'ethernet' one."""
  if shutil.which("ip") is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
    pytest.skip("needs root and iproute2 to create network namespaces")
  if subprocess.run(["ip", "netns", "add", NS], capture_output=True).returncode != 0:
    pytest.skip("creating network namespaces is not permitted here")
  try:
    for prefix, here, there in VETH.values():
      _ip("link", "add", f"{prefix}{os.getpid() % 1000}a", "type", "veth", "peer", "name",
          f"{prefix}{os.getpid() % 1000}b")
      a, b = f"{prefix}{os.getpid() % 1000}a", f"{prefix}{os.getpid() % 1000}b"
      _ip("link", "set", b, "netns", NS)
      _ip("addr", "add", f"{here}/24", "dev", a)
      _ip("link", "set", a, "up")
      _ip("addr", "add", f"{there}/24", "dev", b, ns=NS)
      _ip("link", "set", b, "up", ns=NS)
    _ip("link", "set", "lo", "up", ns=NS)
  except subprocess.CalledProcessError as e:
    subprocess.run(["ip", "netns", "del", NS], capture_output=True)
    pytest.skip(f"cannot set up veth pairs: {e.stderr.strip()}")
  yield {name: f"{prefix}{os.getpid() % 1000}a" for name, (prefix, _, _) in VETH.items()}
  subprocess.run(["ip", "netns", "del", NS], capture_output=True)   # removes the veth pairs


RECEIVER = textwrap.dedent("""
    import sys, time
    from harpjax.runtime.channels import Mailbox, TcpListener
    from harpjax.runtime.interpreter import MessageKey
    box = Mailbox(1)
    lst = TcpListener(sys.argv[1], box, token="t")
    print(lst.endpoint[1], flush=True)
    x = box.get((0, MessageKey("act", 0, 0)), 0, 60, "activations")[1]
    print(int(x.sum()), flush=True)
""")


def _tx_bytes(dev):
  with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
    return int(f.read())


@pytest.mark.parametrize("fabric_shared", [True, False], ids=["fabric", "ethernet"])
def test_bytes_go_over_the_chosen_interface(netns, fabric_shared):
  # Host "left" (this namespace) and host "right" (the other) have an RDMA NIC and an
  # Ethernet NIC. When their RDMA NICs share a network, the fabric is chosen; when not, only
  # Ethernet connects them. The bytes must leave through that interface's veth.
  fab, eth = VETH["fabric"], VETH["ether"]
  left = SubCluster("left", "A100-40G", 1, 1, nics=(
      NIC("ib0", "rdma", 100, "fab"), NIC("eth0", "ethernet", 10, "dc")))
  right = SubCluster("right", "V100-32G", 1, 1, nics=(
      NIC("ib0", "rdma", 100, "fab" if fabric_shared else "fab-right"),
      NIC("eth0", "ethernet", 10, "dc")))
  cluster = Cluster((left, right))
  addresses = {"left-0": {"ib0": fab[1], "eth0": eth[1]},
               "right-0": {"ib0": fab[2], "eth0": eth[2]}}
  route = plan_routes(cluster, ["left-0", "right-0"], [(0, 1)],
                      addresses=transport.normalize_addresses(addresses))[(0, 1)]
  chosen, other = ("fabric", "ether") if fabric_shared else ("ether", "fabric")
  assert route.src_nic == ("ib0" if fabric_shared else "eth0")
  assert (route.src_address, route.dst_address) == (VETH[chosen][1], VETH[chosen][2])

  env = dict(os.environ, PYTHONPATH=os.path.abspath(ROOT), JAX_PLATFORMS="cpu")
  proc = subprocess.Popen(["ip", "netns", "exec", NS, sys.executable, "-c", RECEIVER,
                           route.dst_address], stdout=subprocess.PIPE, text=True, env=env)
  try:
    port = int(proc.stdout.readline())
    before = {k: _tx_bytes(dev) for k, dev in netns.items()}
    payload = np.ones(1_000_000, np.float32)              # 4 MB
    ch = TcpChannel(route.src_address, (route.dst_address, port), "t", src_stage=0)
    ch.send(0, MessageKey("act", 0, 0), 0, {1: ("a", payload)})
    assert int(proc.stdout.readline()) == 1_000_000
    ch.close()
    after = {k: _tx_bytes(dev) for k, dev in netns.items()}
  finally:
    proc.kill()
    proc.wait()
  sent = {k: after[k] - before[k] for k in after}
  assert sent[chosen] >= payload.nbytes, sent
  assert sent[other] < 64_000, sent


def test_runner_finds_nic_addresses_by_interface_name():
  # Workers on "several machines": each NIC's address comes from the interface of that name
  # (here "lo", which every Linux machine has); a NIC without an interface ("ib9") falls back
  # to the object store (in-process for the threads backend). The numbers stay jit's.
  class SeveralMachines(ThreadBackend):
    def single_machine(self, infos):
      return False

    def same_process(self, a, b):
      return False

  lo = NIC("lo", "ethernet", 10, "dc")
  cluster = Cluster((SubCluster("a", "V100-32G", 1, 4, nics=(lo,)),
                     SubCluster("b", "A100-40G", 2, 2, nics=(NIC("ib9", "rdma", 100, "fab"), lo))))
  plan = harpjax.ManualPlan([((0, 0), "a", (1, 2)), ((1, 1), "b", (1, 2)), ((2, 3), "b", (1, 2))])
  model = MLP(features=(16, 16, 16))
  x = jax.random.normal(jax.random.key(0), (8, 12))
  state = train_state.TrainState.create(apply_fn=model.apply,
                                        params=model.init(jax.random.key(1), x),
                                        tx=optax.sgd(0.1))
  batch = {"x": x, "y": jnp.arange(8) % 10}

  def step(state, batch):
    def loss_fn(p):
      return optax.softmax_cross_entropy_with_integer_labels(
          state.apply_fn(p, batch["x"]), batch["y"]).mean()
    loss, grads = harpjax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  pstep = harpjax.auto_parallel(step, cluster=cluster, plan=plan, num_microbatches=2)
  program = pstep.layout(state, batch)
  opts = RunnerOptions(backend="threads", fetch="all")
  runner = PipelineRunner(program, pstep.cluster, (state, batch), SeveralMachines(opts), opts)
  try:
    r = runner.routes
    assert (r[(0, 1)].transport, r[(0, 1)].src_nic, r[(0, 1)].src_address) == \
        ("tcp", "lo", "127.0.0.1")
    assert (r[(1, 2)].transport, r[(1, 2)].src_nic) == ("object_store", "ib9")
    assert "no address for NIC ib9" in r[(1, 2)].reason
    out = runner((state, batch))
    assert max_rel_err(jax.jit(step)(state, batch), out) <= 1e-5
  finally:
    runner.shutdown()
