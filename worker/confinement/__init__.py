"""Making one process a confined node: who it is (uids), what it sees (fsview), what bounds it
(confine: rlimits, seccomp; cgroups: limits and counters), how it is started (privilege; the
zygote that forks a host's node processes). The controller comes in through ``facade`` only."""
