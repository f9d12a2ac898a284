"""What an operator reads in the agent's logs: structured fields in both formats, one line per record."""

from __future__ import annotations

import json
import logging

import pytest

from agent import logs


def record(msg: str, **fields: object) -> logging.LogRecord:
    rec = logging.makeLogRecord({"name": "agent.node", "levelno": logging.INFO, "levelname": "INFO", "msg": msg})
    rec.__dict__.update(fields)
    return rec


def test_text_lines_show_the_structured_fields() -> None:
    """Tried: the fields the JSON format carries (address, recovery, ...) were invisible in text logs."""
    line = logs.TextFormatter().format(
        record("metrics serving", address="127.0.0.1:9400", gpus=8, recovery="removed 1 stale spec", ok=True)
    )
    assert line.endswith(
        'agent.node: metrics serving address=127.0.0.1:9400 gpus=8 recovery="removed 1 stale spec" ok=true'
    )
    assert "\n" not in line


def test_text_fields_are_quoted_so_a_value_cannot_forge_a_field() -> None:
    line = logs.TextFormatter().format(record("claim refused", reason='bad "x"\nother=1', devices=["gpu-0", "gpu-1"]))
    assert "\n" not in line
    assert 'reason="bad \\"x\\"\\nother=1"' in line
    assert 'devices="[\\"gpu-0\\", \\"gpu-1\\"]"' in line


def test_text_line_without_fields_is_just_the_message() -> None:
    assert logs.TextFormatter().format(record("node agent stopped")).endswith("INFO agent.node: node agent stopped")


def test_json_lines_carry_the_fields_as_keys() -> None:
    entry = json.loads(logs.JsonFormatter().format(record("metrics serving", address="127.0.0.1:9400")))
    assert (entry["level"], entry["logger"], entry["msg"], entry["address"]) == (
        "info",
        "agent.node",
        "metrics serving",
        "127.0.0.1:9400",
    )


def test_an_unknown_format_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown log format 'xml' \\(choose json or text\\)"):
        logs.setup("xml")
