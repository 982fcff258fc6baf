"""The batch backends over dask-jobqueue: ``slurm`` and ``pbs`` (``backend``), ``sge`` (``sge``),
``htcondor`` (``htcondor``); job options (``jobs``), the batch systems' command lines
(``batch``), the cluster classes (``cluster``)."""
