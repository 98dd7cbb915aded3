"""The Megatron-core train backend (the `megatron` extra) and its Hugging Face <-> Megatron weight mapping.

`hf_config` and `weights` are plain torch (the mapping is testable without megatron-core); the other modules
import megatron-core.
"""
