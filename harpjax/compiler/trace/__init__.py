"""Phase 1, tracing: the step's jaxpr as a flat :class:`Program`, its pipelined region, and the
per-primitive facts and structural signatures everything downstream reads.

Modules: :mod:`~harpjax.compiler.trace.program` (the flat program and its interpreter),
:mod:`~harpjax.compiler.trace.primitives` (one table of per-primitive facts),
:mod:`~harpjax.compiler.trace.signature` (canonical hashes of ops, layers and jaxprs) and
:mod:`~harpjax.compiler.trace.step` (``value_and_grad``/``grad`` markers and
:func:`trace_step`, which traces the step at full batch and at one microbatch) and
:mod:`~harpjax.compiler.trace.regen` (random draws per microbatch that slice the full batch's),
:mod:`~harpjax.compiler.trace.remat` (the rematerialisation modes a stage may run in),
:mod:`~harpjax.compiler.trace.batchflow` (which values carry the examples, where they meet)
and :mod:`~harpjax.compiler.trace.microbatch` (the program one microbatch runs so that the
microbatches make the batch).
"""

from harpjax.compiler.trace import batchflow, microbatch, primitives, regen, remat, signature
from harpjax.compiler.trace.batchflow import BatchFlow, Coupling, Flow
from harpjax.compiler.trace.microbatch import combine_rules
from harpjax.compiler.trace.primitives import aval_nbytes, aval_size
from harpjax.compiler.trace.program import (eval_ops, from_closed_jaxpr, Lit, Op, ops_function,
                                            Program, RematScope, strip_markers)
from harpjax.compiler.trace.regen import apply_site, regen_sites
from harpjax.compiler.trace.remat import checkpointed, REMAT_MODES, remat_mode
from harpjax.compiler.trace.signature import op_tokens, OpTokens, slice_signature
from harpjax.compiler.trace.step import (abstractify, BATCH_COUPLING, BOUNDARY_PRIMITIVE_NAME, grad,
                                         mark_layer_boundary, REGION_PRIMITIVE_NAME, RegionInput,
                                         trace_step, TracedStep, value_and_grad)

__all__ = [
    "abstractify", "apply_site", "BATCH_COUPLING", "batchflow", "BatchFlow", "combine_rules",
    "Coupling", "Flow", "microbatch", "aval_nbytes", "aval_size", "BOUNDARY_PRIMITIVE_NAME",
    "checkpointed", "eval_ops", "regen", "regen_sites", "remat", "REMAT_MODES", "remat_mode",
    "RematScope",
    "from_closed_jaxpr", "grad", "Lit", "mark_layer_boundary", "Op", "op_tokens", "OpTokens",
    "ops_function",
    "primitives", "Program", "REGION_PRIMITIVE_NAME", "RegionInput", "signature",
    "slice_signature", "strip_markers", "trace_step", "TracedStep", "value_and_grad",
]
