"""How many models become one: the aggregation rules of an FL or E-tree aggregator
(``aggregation``) and the all-reduce structures and chunks of a ring (``allreduce``). Pure
arithmetic on lists of arrays, no messages."""
