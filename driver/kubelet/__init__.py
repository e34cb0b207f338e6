"""Everything the kubelet talks to: plugin registration (`registration`), the DRA gRPC
service (`service`: NodePrepareResources/NodeUnprepareResources, both API versions), the
device health stream (`health`, KEP-4680) and the sockets they listen on (`sockets`).

May import the prepare side and monitoring it serves; the plugin above starts it."""
