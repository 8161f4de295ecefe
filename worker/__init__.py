"""The worker side of the testbed: a host's nodes, links and processes (``worker.host``), served
by the agent (``worker.agent``).

``REPO_ROOT`` is the checkout this code runs from: the code nodes run unless told another.
"""
import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
