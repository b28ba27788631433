"""A training run in a process of its own, for the kill -9 trials of :mod:`tests.faults.harness`.

``python tests/faults/child.py DIRECTORY FINAL SCENARIO_JSON`` resumes from the newest intact
checkpoint in ``DIRECTORY`` (printing ``resumed K``), trains to the scenario's last step
(printing ``step K`` after each), waits for its checkpoints and writes the final state's leaves
to ``FINAL`` (``.npz``).
"""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_enable_x64", True)

from tests.faults import harness  # noqa: E402


def main(directory: str, final: str, scenario: str) -> None:
  scn = harness.Scenario(**json.loads(scenario))
  first = []

  def progress(step):
    print(f"{'step' if first else 'resumed'} {step.steps_done}", flush=True)
    first.append(1)

  step, state = harness.train(scn, directory, on_step=progress)
  step.checkpointer.wait()
  leaves = jax.tree_util.tree_leaves(state)
  np.savez(final, **{f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)})
  print("done", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:4])
