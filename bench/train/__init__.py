"""The native train backend (TorchTrainBackend, FSDP2) on GPUs: throughput and MFU against a plain loop, weak
scaling over N GPUs, the one-rank FSDP2 path and kernels, the LM head's log-probs, colocated offload,
one long sample split by context parallelism."""
