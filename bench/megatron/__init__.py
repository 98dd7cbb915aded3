"""The Megatron backend on GPUs: log-prob parity with the torch backend, throughput against a bare megatron-core
loop, parallel layouts on N GPUs, the fused kernels' timings."""
