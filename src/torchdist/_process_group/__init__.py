"""Layer 2: ProcessGroup, Work, ReduceOp, the backend interface and registry, and backends/."""
