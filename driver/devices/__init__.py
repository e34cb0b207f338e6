"""Device discovery: what accelerators this node has, in vendor-neutral terms."""
