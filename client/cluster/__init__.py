"""Many daemons as one store: membership (etcd or a fixed list), the rendezvous placement of a
page on its nodes, and `ClusterClient`. Built on the contract and the single-node clients."""
