"""Imported by the test ranks' fork server (tests/dist.py PRELOAD): compiles or loads the
fused quantizer kernels and initializes numba once, so that forked ranks do not each pay
numba's first-dispatch set-up (~0.9 s per process on a CI core)."""

from unickpt.codecs.kernels import warm

warm()
