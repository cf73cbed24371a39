"""optimized/_numba_compat.py: the numpy.row_stack shim, and a test that fails once it is no longer needed."""
import importlib.util
import os
import re

import numpy
import pytest


def _numba_cuda_arrayobj_source() -> str:
    spec = importlib.util.find_spec("numba_cuda")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("numba-cuda is not installed (pip install numba-cuda)")
    path = os.path.join(list(spec.submodule_search_locations)[0], "numba", "cuda", "np", "arrayobj.py")
    if not os.path.exists(path):
        pytest.fail(f"numba-cuda layout changed: {path} is missing; check whether the row_stack shim is still "
                    "needed (import numba.cuda with numpy >= 2.5 and launch a kernel) and update this test")
    with open(path) as f:
        return f.read()


def test_numba_cuda_still_registers_row_stack_for_numpy_2_5():
    """Fails when the upstream fix lands: numba-cuda registering `np.row_stack` only for numpy < 2.5 (as numba
    core does) or not at all. Then delete optimized/_numba_compat.py, its imports and this file."""
    src = _numba_cuda_arrayobj_source()
    m = re.search(r"^if (?P<cond>[^\n]*):\s*\n\s*overload\(np\.row_stack\)", src, re.M)
    assert m is not None, ("numba-cuda no longer registers np.row_stack under an `if` guard: the numpy 2.5 "
                           "problem is fixed upstream; delete optimized/_numba_compat.py and its imports")
    assert "(2, 5)" not in m.group("cond"), (
        f"numba-cuda now guards np.row_stack with `{m.group('cond')}`: the upstream fix landed; delete "
        "optimized/_numba_compat.py, its imports and this test")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_shim_defines_row_stack_only_when_missing():
    import optimized._numba_compat as compat
    a, b = numpy.ones((1, 2)), numpy.zeros((1, 2))
    assert (numpy.row_stack((a, b)) == numpy.vstack((a, b))).all()
    # numpy < 2.5 keeps its own row_stack (untouched); from 2.5 on the shim supplies vstack
    assert compat.ROW_STACK_SHIMMED == (numpy.lib.NumpyVersion(numpy.__version__) >= "2.5.0")
