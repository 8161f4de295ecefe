"""Models in numpy alone (no TensorFlow): the layers (``layers``) and the ``Sequential`` net they make
(``net``), the hand-written MLP (``mlp``), their shared training loop (``minibatch``) and seeded
draws without ``numpy.random`` (``rand``); ``builder`` is the numpy kind ``make_model`` uses."""
