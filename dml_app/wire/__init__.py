"""What crosses the wire from others, bounded: model weights (``weights``, the safetensors layout,
never pickle) and JSON parsed in linear time with its nesting bounded (``bounded_json``)."""
