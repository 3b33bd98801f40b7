"""What the model's tool calls run in: the code sandbox."""
