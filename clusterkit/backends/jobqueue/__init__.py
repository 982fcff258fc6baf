"""The ``slurm`` and ``pbs`` backends over dask-jobqueue: job options and the backends
(``backend``), the batch systems' command lines (``batch``), the cluster classes (``cluster``)."""
