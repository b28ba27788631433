"""The compiler: from a train step to per-stage executables, one subpackage per phase.

:mod:`~harpjax.compiler.trace` -> :mod:`~harpjax.compiler.layers` ->
:mod:`~harpjax.compiler.profile` -> :mod:`~harpjax.compiler.schedule` ->
:mod:`~harpjax.compiler.plan` -> :mod:`~harpjax.compiler.stages`. A phase imports only from the
phases before it (and from :mod:`harpjax.cluster`), each through that phase's
``__init__.py``; nothing here imports the runtime or Ray (``tests/test_layout.py`` checks it).
"""
