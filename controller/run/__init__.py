"""One experiment's lifecycle: the run's state machine, its nodes, scenario steps, progress output."""
