"""RL objectives and (with the trainer issue) advantages and the sharded train step."""
