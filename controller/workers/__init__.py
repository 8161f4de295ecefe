"""Reaching worker hosts: the agent client, the cluster of several hosts, deploy, served files, the testbed lock."""
