"""Code shared by every pagedserve stage: typed messages, sockets, config, model files."""
