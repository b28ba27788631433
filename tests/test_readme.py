"""The README's user example runs as written."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_readme_example_runs(monkeypatch):
  text = open(os.path.join(ROOT, "README.md")).read()
  code = re.search(r"## Twenty lines\n\n```python\n(.*?)```", text, re.S).group(1)
  monkeypatch.chdir(ROOT)
  scope = {}
  exec(compile(code, "README.md", "exec"), scope)
  assert scope["plan"].warmups == (4, 2, 1)
  assert float(scope["loss"]) > 0


def test_demo_runs(capsys):
  # `make demo`'s job, one step of the hand-made plan (the planned half is the README example's
  # and the planner tests' business).
  from harpjax.examples import demo
  demo.main(["--plan", "manual", "--steps", "2", "--microbatches", "2"])
  out = capsys.readouterr().out
  losses = re.findall(r"loss (\S+)\s+\(jax.jit: (\S+)\)", out)
  assert len(losses) == 2 and all(a == b for a, b in losses)
  err = float(re.search(r"\| = (\S+) \(float32", out).group(1))
  assert err < 1e-4
