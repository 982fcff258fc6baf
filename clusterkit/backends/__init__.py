"""Backends: one module per cluster system, behind the protocol in ``base``."""
