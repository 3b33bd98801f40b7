"""How a step's samples are made: stage fusion and asynchronous rollout replicas."""
