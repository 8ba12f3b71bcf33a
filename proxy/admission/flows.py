"""Who a media request waits for: its ``Flow``, a flow id from ``MMGATE_FAIRNESS_HEADER`` and a priority band from
``MMGATE_PRIORITY_HEADER`` (the gate serves flows in turn within a band, and bands strictly)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from preprocessors.errors import INVALID_FLOW_HEADER, INVALID_PRIORITY_HEADER


@dataclass(frozen=True, slots=True)
class Flow:
    """Who a media request waits for: a flow id (``""``: no fairness header) and a priority band."""

    id: str = ""
    band: int = 0

    def named(self) -> str:
        return f"flow {self.id!r}" if self.id else "the default flow"


DEFAULT_FLOW = Flow()


MAX_FLOW_ID_CHARS = 128  # a longer id is refused: ids are echoed in refusals and kept while a flow waits


def flow_for(headers: Mapping[str, str], fairness_header: str, priority_header: str,
             bands: tuple[int, int]) -> Flow:
    """The flow a request's headers name. No headers: ``DEFAULT_FLOW`` (one FIFO, as without fairness). The
    priority is an integer (RFC 9110 section 5.5 field value), clamped to ``bands``; anything else is 400."""
    flow_id = headers.get(fairness_header, "").strip()
    raw = headers.get(priority_header)
    if not flow_id and raw is None:
        return DEFAULT_FLOW
    if len(flow_id) > MAX_FLOW_ID_CHARS or not flow_id.isprintable():
        raise INVALID_FLOW_HEADER.error(f"{fairness_header} must be at most {MAX_FLOW_ID_CHARS} printable characters")
    band = 0
    if raw is not None:
        try:
            band = int(raw.strip())
        except ValueError:
            raise INVALID_PRIORITY_HEADER.error(f"{priority_header} must be an integer, got {raw[:32]!r}") from None
        band = max(bands[0], min(bands[1], band))
    return Flow(flow_id, band)
