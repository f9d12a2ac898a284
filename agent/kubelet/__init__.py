"""Kubelet gRPC servers: plugin registration, DRAPlugin v1/v1beta1, DRAResourceHealth and liveness."""

from agent.kubelet.health import DeviceHealth, Health, HealthSource
from agent.kubelet.plugin import KubeletPlugin
from agent.kubelet.registration import RegistrationFailed, RegistrationStatus

__all__ = ["DeviceHealth", "Health", "HealthSource", "KubeletPlugin", "RegistrationFailed", "RegistrationStatus"]
