"""Convolutional networks in numpy: layers (``layers``), a Sequential net (``net``) and the named nets (``zoo``)."""
