"""Everything the kubelet talks to: registration, the DRA service, the health stream."""
