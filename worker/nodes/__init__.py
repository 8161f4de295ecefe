"""Node runtimes (netns, Docker, physical) and the processes in them: privilege, zygote, cgroups, confinement."""
