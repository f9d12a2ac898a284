"""Upstream's control plane for the real integration tier.

go.mod, go.sum, etcd/    the pinned Go modules (k8s.io/kubernetes v1.37 and etcd v3.6)
build.py                 builds the four binaries into a cache outside the checkout (`make control-plane`)
pki.py                   certificates and service-account keys made at start
cluster.py               etcd + kube-apiserver + kube-controller-manager + kube-scheduler on loopback
"""
