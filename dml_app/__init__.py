"""What runs inside a node: it takes its confs, trains and exchanges models with its peers, and
reports to the controller. It imports nothing of ``controller``, ``worker`` or ``dml_tool``.

The rooms, each importing only rooms listed above it::

    wire/          what comes from others, bounded: the weights format (weights.py, the
                   safetensors layout, never pickle) and JSON parsed in linear time (bounded_json.py)
    runtime/       what a node process stands on: HTTP router and client (http.py), signatures
                   (auth.py), how messages reach peers (transport.py), the event log (events.py),
                   the compute thread (compute.py), loading the user's files (usercode.py)
    reduction/     how many models become one: the aggregation rules (aggregation.py: FedAvg,
                   FedAvgM, trimmed mean, median), all-reduce structures and chunks (allreduce.py)
    models/        the model contract (contract.py), each built-in network described once
                   (architectures.py), a builder per kind of model (numpy/, keras.py; a PyTorch
                   builder is one more), the user's model file (user.py), make.py (a conf to a
                   model), the run's global test set (global_test.py)
    policies/      adaptation: the contract (contract.py: Policy, PolicyView, votes, actions),
                   the runner (runner.py), the built-in kinds (builtin.py), the monitors they
                   decide on (monitors.py)
    roles/         the learning roles: the round loop they share (base.py), their helpers
                   (shared.py), gossip.py, fl.py, etree.py, ring.py (its formations:
                   ring_membership.py), the roles by name and the user's replacements
                   (registry.py), an in-memory transport for tests (memory.py)

and at the top, the two processes and a path kept for users' files::

    node.py        the node process: ``python3 -m dml_app.node --name N --controller URL ...``
    probe.py       a user's file tried in the sandbox: ``python3 -m dml_app.probe < request.json``
    model_numpy.py ``NumpyMLP`` where a user's model file imports it from

A user's files import from ``dml_app.roles.base`` and ``dml_app.roles.<gossip|fl|etree|ring>``
(an algorithm subclasses a role), ``dml_app.policies`` (a policy) and ``dml_app.model_numpy``.
"""
