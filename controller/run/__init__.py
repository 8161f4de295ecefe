"""One experiment's lifecycle: the run's state machine (experiment), its nodes and their client (nodes),
membership, what it records (recording), scenario steps, progress output."""
