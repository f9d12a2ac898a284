"""Device selectors for the local allocator, in DRA's CEL environment (agent.allocation.cel).

Behind the small `SelectorEngine` interface, so the allocator core can be tested with a stub.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from agent.allocation.cel import DeviceSelector, MissingAttribute, SelectorError

__all__ = ["CelSelectors", "SelectorEngine", "SelectorError"]


class SelectorEngine(Protocol):
    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        """True when `expression` holds for `device` (DRA's CEL `device` variable, see cel.device_variable)."""
        ...


class CelSelectors:
    """SelectorEngine over DRA's CEL environment, compiling each expression once."""

    def __init__(self) -> None:
        self._selectors: dict[str, DeviceSelector] = {}

    def matches(self, expression: str, device: Mapping[str, Any]) -> bool:
        selector = self._selectors.get(expression)
        if selector is None:
            selector = self._selectors[expression] = DeviceSelector(expression)
        try:
            return selector.matches(device)
        except MissingAttribute:
            # Not Kubernetes' rule: there a selector that errors on any device fails allocation for the whole
            # claim. The local allocator treats that device as not matching instead, so a claim no device
            # matches gets NoFit, which the arbiter can try on another node. Other errors still propagate.
            return False
