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
