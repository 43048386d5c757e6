"""Dataset adapters, found by name: `build_source("covid-chestxray", {...}, SourceContext.of(config))`.

Importing this package registers every adapter module listed below.
"""

from __future__ import annotations

from typing import Any

from covidxray.config import from_dict
from covidxray.sources import (  # noqa: F401  (importing registers)
    chest_xray_pneumonia,
    covid19_talo,
    covid_chestxray,
    kermany,
    synthetic,
)
from covidxray.sources.base import SOURCE_REGISTRY, Fetched, Source, SourceContext, SourceOptions

__all__ = ["SOURCE_REGISTRY", "Fetched", "Source", "SourceContext", "SourceOptions", "build_source"]


def build_source(name: str, options: dict[str, Any] | None = None, context: SourceContext | None = None) -> Source:
    """The adapter registered as `name`, its options checked against its own `Options` (unknown keys refused)."""
    cls = SOURCE_REGISTRY.get(name)
    return cls(from_dict(cls.Options, dict(options or {}), f"data.sources.{name}"), context)
