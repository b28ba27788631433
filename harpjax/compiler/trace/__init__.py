"""Phase 1, tracing: the step's jaxpr as a flat :class:`Program`, its pipelined region, and the
per-primitive facts and structural signatures everything downstream reads.

Modules: :mod:`~harpjax.compiler.trace.program` (the flat program and its interpreter),
:mod:`~harpjax.compiler.trace.primitives` (one table of per-primitive facts),
:mod:`~harpjax.compiler.trace.signature` (canonical hashes of ops, layers and jaxprs) and
:mod:`~harpjax.compiler.trace.step` (``value_and_grad``/``grad`` markers and
:func:`trace_step`, which traces the step at full batch and at one microbatch).
"""

from harpjax.compiler.trace import primitives as primitives
from harpjax.compiler.trace import signature as signature
from harpjax.compiler.trace.primitives import aval_nbytes as aval_nbytes
from harpjax.compiler.trace.primitives import aval_size as aval_size
from harpjax.compiler.trace.program import Lit as Lit
from harpjax.compiler.trace.program import Op as Op
from harpjax.compiler.trace.program import Program as Program
from harpjax.compiler.trace.program import eval_ops as eval_ops
from harpjax.compiler.trace.program import from_closed_jaxpr as from_closed_jaxpr
from harpjax.compiler.trace.program import strip_markers as strip_markers
from harpjax.compiler.trace.signature import OpTokens as OpTokens
from harpjax.compiler.trace.signature import op_tokens as op_tokens
from harpjax.compiler.trace.signature import slice_signature as slice_signature
from harpjax.compiler.trace.step import BOUNDARY_PRIMITIVE_NAME as BOUNDARY_PRIMITIVE_NAME
from harpjax.compiler.trace.step import REGION_PRIMITIVE_NAME as REGION_PRIMITIVE_NAME
from harpjax.compiler.trace.step import RegionInput as RegionInput
from harpjax.compiler.trace.step import TracedStep as TracedStep
from harpjax.compiler.trace.step import abstractify as abstractify
from harpjax.compiler.trace.step import grad as grad
from harpjax.compiler.trace.step import mark_layer_boundary as mark_layer_boundary
from harpjax.compiler.trace.step import trace_step as trace_step
from harpjax.compiler.trace.step import value_and_grad as value_and_grad

__all__ = [
    "abstractify", "aval_nbytes", "aval_size", "BOUNDARY_PRIMITIVE_NAME", "eval_ops",
    "from_closed_jaxpr", "grad", "Lit", "mark_layer_boundary", "Op", "op_tokens", "OpTokens",
    "primitives", "Program", "REGION_PRIMITIVE_NAME", "RegionInput", "signature",
    "slice_signature", "strip_markers", "trace_step", "TracedStep", "value_and_grad",
]
