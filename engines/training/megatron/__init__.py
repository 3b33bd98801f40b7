"""The megatron-core training backend: the engine, HF <-> megatron weight conversion, the process groups each model
passes megatron, and fused actor/critic pipelines. Importing this package imports no megatron-core."""
