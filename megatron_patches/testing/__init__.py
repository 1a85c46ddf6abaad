"""Test support: the CPU runtime for megatron-core. Nothing here runs on import."""
