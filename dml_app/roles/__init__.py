"""The learning roles a node plays: ``base`` (the round loop, sending, traffic and events every role
shares; a user's algorithm subclasses a role and imports ``Context``, ``RoundRecord``, ``Weights``
from here), the helpers roles share (``shared``), one module per algorithm (``gossip``, ``fl``,
``etree``, ``ring``, the ring's formations in ``ring_membership``), the roles by name and the user's
replacements (``registry``), and an in-memory transport for tests of a protocol (``memory``)."""
