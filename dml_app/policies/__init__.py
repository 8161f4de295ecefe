"""Adaptation policies: code that watches the training and changes how it runs.

A policy sees each round's metrics (``after_round``) and answers with its *vote*: a small JSON
object of this node's inputs. ``decide`` turns the votes of the nodes that decide together into
an *action* (``{"strategy": "star:n3"}``, ``{"batch_size": 64}``) or None. Who decides: every
ring member, on the votes of every member of the next formation (each member decides the same
way, as in KungFu: the votes travel with the ring's formation, so every member sees the same
ones); a gossip node, the FL aggregator and an E-tree parent each on their own vote.

Every decision that acts is a ``policy_decision`` event (round, policy, inputs, votes, action).

Policies of the structure file's ``policies`` list: the built-in kinds (``builtin.KINDS``) or the
user's own class (``{"module": "policies/mine.py", "class": "Mine", ...}``), a subclass of
``Policy`` built with its conf (every key of its entry) and a ``PolicyView`` of the node.

The room: ``contract`` (``Policy``, ``PolicyView``, votes and actions and their checks),
``runner`` (a node's policies built and run together), ``builtin`` (the built-in kinds),
``monitors`` (what policies decide on: the gradient noise scale and variance). A user's policy
file imports what it needs from here (``from dml_app.policies import Policy, PolicyView``).
"""
from __future__ import annotations

from dml_app.policies.builtin import AdaptiveBatch, AdaptiveStrategy, ElasticScaling
from dml_app.policies.contract import Action, Policy, PolicyError, PolicyView, Vote

__all__ = ["Action", "Policy", "PolicyError", "PolicyView", "Vote", "AdaptiveBatch", "AdaptiveStrategy",
           "ElasticScaling"]
