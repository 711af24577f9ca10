"""The bridge's settings (clients/bridge/config.py): every one of them does something."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from clients.bridge.config import BridgeConfig

BRIDGE = Path(__file__).resolve().parents[3] / "clients" / "bridge"
CONFIG_NAMES = ("cfg",)  # what the bridge calls its BridgeConfig: `cfg`, `self.cfg`, `x.cfg`


def settings_read(source: str) -> set[str]:
    """Attributes read from a BridgeConfig in `source`: `<...>cfg.<name>`, nothing else."""
    read = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if name in CONFIG_NAMES:
                read.add(node.attr)
    return read


def test_settings_read_counts_only_the_config_object():
    """A field's name on any other object (`self.port`, `request.model`) is not a read of it."""
    source = "cfg.host\nself.cfg.port\nbridge.cfg.token\nself.model\nrequest.origins\ncfg.x = 1"
    assert settings_read(source) == {"host", "port", "token"}


def test_every_setting_is_read_by_the_bridge():
    """Each BridgeConfig field is read from the bridge's config object somewhere in the bridge's
    code: a setting that nothing reads (as ping_timeout_s once was) promises a behaviour the
    bridge does not have."""
    read = set().union(*(settings_read(p.read_text(encoding="utf-8")) for p in BRIDGE.glob("*.py")))
    unread = [f.name for f in dataclasses.fields(BridgeConfig) if f.name not in read]
    assert unread == []
