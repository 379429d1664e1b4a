"""Zero-code metrics: the ranks ``sar-worker`` and ``torchrun --rdzv-backend=sarcomm`` start get
sarcomm's per-collective metrics, ``/metrics`` endpoint and progress notes without a line of code.

- :mod:`.entry`: the ``torch.backends`` entry point ``import torch`` calls in every process of the
  environment; it decides, from a few variables and nothing imported, whether this process is a
  rank to instrument, and only then loads the rest.
- :mod:`sarcomm.worker.library.zerocode`: what an instrumented rank runs (dispatcher kernels in
  front of torch's ``c10d`` ops, the completion hook on nccl).

Why this mechanism, and what it does not cover: docs/metrics.md, "Zero-code metrics".
"""
