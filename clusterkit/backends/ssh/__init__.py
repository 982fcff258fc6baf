"""The ``ssh`` backend: a plan per host (``spec``), asyncssh helpers (``remote``), the cluster
object (``cluster``) and the backend itself (``backend``)."""
