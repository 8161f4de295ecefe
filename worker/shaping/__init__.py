"""Link shaping: a pure plan, its application by netlink, the access downlinks."""
