"""clusterkit test suite."""
