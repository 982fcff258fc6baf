"""The ``kubernetes`` backend over the dask-kubernetes operator: DaskCluster manifests
(``manifest``), the operator's cluster handle (``cluster``) and the backend (``backend``)."""
