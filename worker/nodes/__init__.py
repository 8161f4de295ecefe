"""Node runtimes (netns, Docker with its swarm fabric, physical) behind one ``Runtime`` interface
(``runtime``), and the processes in their nodes (``processes``). What makes a process a confined
node is ``worker.confinement``."""
