"""Backend-agnostic data parallelism: gradient buckets and DistributedDataParallel."""
