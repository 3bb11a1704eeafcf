"""State, step and loop: the trainer's moving parts (see jaxmp.Trainer for the front door)."""
