"""The trainer role: a row cache kept in step with the oracle's plan, and the model trained from it.

- ``runtime``: ``TrainerRuntime``, the cache sync (prefetch, write-back, the boundary of each iteration) and the
  object that holds the trainer's components.
- ``grad_sync``: the sums of gradients over trainers and the row updates waiting for them.
- ``recovery``: a lost trainer's replacement, the survivors' side and its own.
- ``loop``: the training loop of ``--mode bagpipe`` and the model it trains (``DenseModel``).
- ``handlers``: what a trainer process answers (runtime/endpoints.py's ``TRAINER``).
- ``main``: the role's process, ``run_trainer`` (``bagpipe trainer``), as stages.
"""
