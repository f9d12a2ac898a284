"""What claim preparation needs to create and destroy MIG devices (agent.nvml.migctl.MigControl does it).

A Protocol, so the claims package never imports pynvml and tests can pass a fake. GPUs are named by uuid.
"""

from __future__ import annotations

from typing import Protocol


class MadeMig(Protocol):
    """A MIG device `create` made."""

    @property
    def gpu_instance_id(self) -> int: ...

    @property
    def compute_instance_id(self) -> int: ...

    @property
    def uuid(self) -> str: ...


class MigDevices(Protocol):
    def create(self, parent: str, gi_profile_id: int, start: int) -> MadeMig:
        """A GPU instance at the placement with a full-size compute instance, or an exception and nothing
        left behind, unless the exception has a true `left_behind` attribute (cleaning up failed too)."""
        ...

    def destroy(self, parent: str, gpu_instance_id: int, compute_instance_id: int | None) -> None:
        """Compute instance, then GPU instance; instances already gone count as destroyed."""
        ...

    def destroy_at(self, parent: str, gi_profile_id: int, start: int) -> bool:
        """Destroy the GPU instance of this profile at this placement with its compute instances, if any
        (repairs a crash between creating a device and saving its ids). False when there was none."""
        ...

    def switch_mig_mode(self, parent: str, enabled: bool) -> None:
        """Turn the GPU's MIG mode on or off at once (a no-op when it already is), or raise and change
        nothing where that needs a reset or the GPU is busy."""
        ...


def left_behind(exc: BaseException) -> bool:
    """Whether a failed `create` may have left part of the device at its placement."""
    return bool(getattr(exc, "left_behind", False))
