"""paged-triton-common: the Triton runtime the paged Triton backends share.

It registers no backend. Its modules are imported by name (importing this package imports
neither torch nor Triton):

- :mod:`paged_triton_common.tiles`: the ``@triton.jit`` helpers of the attention tiles.
- :mod:`paged_triton_common.direct`: direct launch of compiled kernels, recordings of a layer's
  launches, capture-safe first calls; the only module that reaches into Triton internals.
- :mod:`paged_triton_common.backend`: ``TritonBackend`` and ``TritonPlan``.
- :mod:`paged_triton_common.write`: the one-launch ``Backend.write``.
- :mod:`paged_triton_common.tuning`: autotuning timed as CUDA-graph replays.
- :mod:`paged_triton_common.runtime`: the interpreter/autotune switches, SM count, occupancy.
"""

__version__ = "0.1.0"
