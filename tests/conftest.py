"""Suite-wide settings: single-threaded BLAS and torch.

The suite runs on 2-core CI machines next to other processes; threaded BLAS
there costs far more in contention than it gains, and one thread also keeps
float reduction order fixed from run to run.
"""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
