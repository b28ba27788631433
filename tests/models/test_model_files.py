"""Mixtral-shaped models named on the command line: built in, or a YAML file of fields."""

from __future__ import annotations

import click
import pytest

from harpjax.cli.model import model_spec
from harpjax.models import BUILTIN_MODELS, MIXTRAL_8X7B, Mixtral


def test_mixtral_family_file_takes_its_fields_and_defaults(tmp_path):
  f = tmp_path / "mix.yaml"
  f.write_text("family: mixtral\nnum_blocks: 2\nhidden: 64\nnum_heads: 4\nnum_kv_heads: null\n"
               "ffn_hidden: 96\ncapacity_factor: null\nrouting_group: sequence\ntop_k: 1\n"
               "aux_loss_coef: 0\nseq_len: 32\nvocab_size: 128\nmicrobatch_size: 2\n")
  spec = model_spec(str(f), 2, None)
  c = spec.config
  assert isinstance(spec.model, Mixtral) and spec.name == "mix"
  assert (c.num_blocks, c.hidden, c.kv_heads, c.capacity_factor, c.routing_group, c.top_k,
          c.aux_loss_coef) == (2, 64, 4, None, "sequence", 1, 0)
  assert c.num_experts == MIXTRAL_8X7B.num_experts and c.dtype == MIXTRAL_8X7B.dtype
  assert spec.args[1]["tokens"].shape == (4, 32)


@pytest.mark.parametrize("line,what", [("routing_group: device", "routing_group"),
                                       ("routing_group: 3", "must be a string"),
                                       ("aux_loss_coef: -1", "must be >= 0"),
                                       ("top_k: 3", "top_k")])
def test_mixtral_family_file_errors_name_the_field(tmp_path, line, what):
  f = tmp_path / "bad.yaml"
  f.write_text(f"family: mixtral\nnum_blocks: 1\n{line}\n")
  with pytest.raises(click.BadParameter, match=what):
    model_spec(str(f), 1, None)


def test_builtin_mixtral_models():
  assert {"mixtral-8x7b", "mixtral-tiny"} <= set(BUILTIN_MODELS)
  spec = BUILTIN_MODELS["mixtral-tiny"](num_microbatches=2)
  assert isinstance(spec.model, Mixtral) and spec.config.top_k == 2
