"""The planner's array types, and the numpy reductions it calls directly.

``ndarray.max()``, ``.any()`` and ``.sum()`` go through a Python wrapper; the
ufunc's ``reduce`` does not, and these run for every group of every read.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

I64 = NDArray[np.int64]
I32 = NDArray[np.int32]

umax = np.maximum.reduce
uany = np.logical_or.reduce
uadd = np.add.reduce
