"""The batch backends over dask-jobqueue, in its shape: one module per batch system on one
shared core.

- ``slurm``, ``pbs``, ``sge``, ``htcondor``: each batch system's queue commands, its backend
  subclass and its cluster class;
- the shared core, from the top: ``core`` (``JobQueueBackend``: render, create, describe,
  evidence, logs, teardown, doctor), ``cluster`` (the job/cluster base: submission,
  replacement, a close that drains the queue), ``jobs`` (dask-jobqueue's Job options) and
  ``commands`` (the queue-command plumbing: ``JobInfo``, ``BatchQueue``, ``run_command``).

Imports point from the systems to the core and down it, never back.
"""
