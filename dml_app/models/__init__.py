"""A node's model: the contract every model keeps (``contract``), the built-in networks described once
(``architectures``), one builder per kind of model (numpy: ``numpy/``, Keras: ``keras``; a third
kind is a third such module), the user's own model file (``user``), and ``make`` that picks among
them from the structure file's ``model`` conf; ``global_test`` reads the run's common test set.

A new built-in network is one description in ``architectures.NETWORKS``: every kind builds it.
"""
