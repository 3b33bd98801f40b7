"""Models: `ModelConfig` and the builders (`config`), tokenizers (`tokenizer`, with the committed character-level
one in assets/), and pretrained weights for the opt-in SmolLM2 runs (`pretrained`)."""
