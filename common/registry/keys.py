"""Redis key names. Every key lives under "<namespace>:" so that a namespace can be listed and
cleared as a whole (`SCAN MATCH <namespace>:*`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_GLOB_CHARS = re.compile(r"([*?\[\]\\])")


def glob_escape(text: str) -> str:
    """text as a literal inside a Redis MATCH pattern."""
    return _GLOB_CHARS.sub(r"\\\1", text)


@dataclass(frozen=True, slots=True)
class KeySpace:
    namespace: str

    def __post_init__(self) -> None:
        if not self.namespace:
            raise ValueError("namespace must not be empty")

    def instance(self, instance_id: str) -> str:
        """String: the InstanceInfo JSON, expiring with the instance's TTL."""
        return f"{self.namespace}:instance:{instance_id}"

    def prefix(self, instance_id: str) -> str:
        """Set of decimal block hashes cached by the instance, expiring with it."""
        return f"{self.namespace}:prefix:{instance_id}"

    def pattern(self, kind: str) -> str:
        """MATCH pattern for every key of one kind ("instance", "prefix")."""
        return f"{glob_escape(self.namespace)}:{kind}:*"

    def all(self) -> str:
        return f"{glob_escape(self.namespace)}:*"
