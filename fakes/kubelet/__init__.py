"""A kubelet fake that drives DRA plugins over the real gRPC protocol (registration, prepare, health)."""

from fakes.kubelet.kubelet import FakeKubelet, HealthWatch, KubeletError, Plugin, Retry
from fakes.kubelet.preparer import InMemoryPreparer

__all__ = ["FakeKubelet", "HealthWatch", "InMemoryPreparer", "KubeletError", "Plugin", "Retry"]
