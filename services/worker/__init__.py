"""The worker: loads the model and runs its steps (python -m services.worker).

Before anything loads torch's OpenMP runtime (which reads its settings once, at
load): threads that finish a parallel region spin only briefly before they
sleep, unless the operator chose (OMP_WAIT_POLICY, GOMP_SPINCOUNT). libgomp's
default spins for milliseconds, which is harmless on cores the worker has to
itself and ruinous where it shares them: with the whole chain on two cores and
one other busy process, a 32-token answer took 35 s instead of 0.33 s, as
the spinning threads took the turns of the thread the step waited for; at
10,000 spins it took 2.1 s, and idle it is no slower (bench/busy_neighbour.py,
docs/performance.md).
"""
import os

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
