"""The node side of a real cluster for the `node` tier: kubelet, containerd, runc, CNI plugins, crictl.

kubelet/, containerd/, runc/, cni/, crictl/   one pinned go.mod each
build.py                                      builds them into a cache outside the checkout (`make node-stack`)
images.py                                     the pause and workload images as OCI archives, made from Debian's busybox
node.py                                       containerd + kubelet registered to a ControlPlane, and the agent
"""
