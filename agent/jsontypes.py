"""The one name for a JSON object as the API reads and writes it (parsed, not yet typed). Pure."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]
