"""`python -m kernels_cuda` = `python -m kernels_cuda.build`."""

import sys

from .build import main

sys.exit(main())
