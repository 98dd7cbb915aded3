"""The rollout side: the embedded engine's throughput against HF generate, the paged decode kernels, the HTTP
server's continuous batching, and the table of SGLang's launch_server flags that recipe validation reads."""
