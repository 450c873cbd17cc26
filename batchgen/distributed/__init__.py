"""Tensor parallelism over torch.distributed: rank 0 (the LLM's process) schedules and samples,
every rank runs its shard of each forward over its own KV pool of local heads."""
