"""Run plumbing the recipe stands on: the process world (distributed), checkpoints and run folders (checkpoint, runs,
outputs), signals and time limits (preemption), and what a run reports (monitor, tracking)."""
