"""Numba compatibility shims, imported first by every Numba kernel module (GPU.md, "Known software problem").

numba-cuda 0.30.4 registers an overload for `numpy.row_stack` whenever numpy >= 2.0, but numpy 2.5 removed
`row_stack`, so the first kernel launch fails with "module 'numpy' has no attribute 'row_stack'". Numba core
fixed the same registration with a `numpy_version < (2, 5)` guard; numba-cuda has not yet. Until it does,
restore the name as the alias it always was (`vstack`), and only when it is missing.

conformance/test_numba_compat.py fails once the installed numba-cuda carries the guard: then delete this
module and its imports.
"""
import numpy

ROW_STACK_SHIMMED = not hasattr(numpy, "row_stack")
if ROW_STACK_SHIMMED:
    numpy.row_stack = numpy.vstack
