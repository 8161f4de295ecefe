"""Per-node confs and dataset shards in EdgeTB's shapes, from the structure and dataset files."""
