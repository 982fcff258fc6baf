"""How a profile becomes a running cluster and stays one: the one start path (``start``), the
detached supervisor (``supervisor``), its control socket (``control``) and process spawning
(``spawn``)."""
