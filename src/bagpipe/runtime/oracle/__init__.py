"""The oracle role: read the data in order, plan, and hand every trainer its slice and its plan.

- ``feed``: the planner over the global batches and each trainer's queue of plan messages, pulled.
- ``failures``: lost processes the job goes on without, and their replacements.
- ``state``: what the oracle's threads share (servers ready, trainers' reports, the job's failure).
- ``service``: ``Oracle``, the job's components whole once built, and what the oracle answers.
- ``summary``: the end of a job: the model evaluated and written, the run's summary.
- ``main``: the role's process, ``run_oracle`` (``bagpipe oracle``): the job started or taken over, then run.
"""
