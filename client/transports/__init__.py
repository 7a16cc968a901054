"""How bytes reach one daemon: gRPC (the protobuf conversions), the same-host lane and shared
segments, the TCP and UCX bulk data paths, TLS, and the host identity that picks among them.
Built on client.contract; knows nothing of the cluster."""
