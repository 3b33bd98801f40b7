"""Training backends: torch-native FSDP2 / DTensor TP (`torch_native`, `parallel`) and megatron-core (`megatron`,
imported only when asked for), with what both take (`common`: OptimConfig, LossFn)."""
