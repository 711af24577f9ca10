"""The bridge's settings (clients/bridge/config.py): every one of them does something."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from clients.bridge.config import BridgeConfig

BRIDGE = Path(__file__).resolve().parents[2] / "clients" / "bridge"


def test_every_setting_is_read_by_the_bridge():
    """Each BridgeConfig field is read somewhere in the bridge's code: a setting that nothing
    reads (as ping_timeout_s once was) promises a behaviour the bridge does not have."""
    read = {
        node.attr
        for path in BRIDGE.glob("*.py")
        if path.name != "config.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
    }
    unread = [f.name for f in dataclasses.fields(BridgeConfig) if f.name not in read]
    assert unread == []
