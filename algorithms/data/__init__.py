"""Prompts, datasets and the synthetic tasks (with their rule rewards and tools)."""
