"""RL: trajectories, packing, advantages, the objectives and the sharded trainer."""
