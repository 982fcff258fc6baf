"""Runners: ML work (hyperparameter search, distributed training) over any Dask Client."""
