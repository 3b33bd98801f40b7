"""Rollout backends: the transformers engine (`hf`), vLLM (`vllm_engine`, imported only when asked for), and the
streaming / long-tail migration protocol both speak (`stream`)."""
