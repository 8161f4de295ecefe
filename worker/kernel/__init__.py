"""System-call and netlink primitives: netlink messages, namespace files, /proc."""
