"""ocrvl's throughput benchmark (see bench/README.md)."""
