"""What a front and the shared gate (``processes.remote_gate``) say to each other over their link
(``processes.link``): one frozen dataclass per message, and how each becomes the bytes of a frame.

A message travels as an orjson array: its ``TAG``, then its fields in order (a ``Flow``, the ``GateCounters``
and a ``Sample`` as arrays of theirs). Both ends are the same program, so the wire needs no versions; bytes that
decode to no message are a fault.

front -> gate: ``Ready`` (the front listens); ``TakePlace`` and ``Acquire`` (``Gate.take_place``, ``acquire``;
an ``Acquire`` names the place it turns into a queue entry); ``Cancel`` (the request gave up waiting);
``Unplace``, ``Release``, ``HandedOff``, ``Lower``, ``Observe`` (what a place or a lease does, never answered);
``Collect`` (every front's metrics, merged); ``AskCounters``; ``Peek`` (which cache entries another front holds);
and the answers to the gate's questions: ``Report``, ``Found``, ``Pong``.

gate -> front: an ``Answer`` to each question, with the gate's counters after it (the front mirrors them in its
gauges): ``Placed``, ``Admitted``, ``Counted``, ``Collected``, ``Peeked``; ``Refused`` (a refusal from the
error registry, rebuilt at the front as the very error the gate raised) or ``WaitCancelled`` (a wait the front
called off, or that ended with the front: no refusal, nobody to tell); and its own questions: ``AskReport``,
``Lookup``, ``Ping`` (answered by the front's event loop: the supervisor's watchdog).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import orjson

from preprocessors.errors import REGISTRY, MmgateError, rebuild
from preprocessors.job import Refusal, Verdict
from proxy.admission.client import GateCounters
from proxy.admission.flows import Flow
from proxy.admission.sample import Sample

# Seconds a front has to answer ``AskReport``: a report is built in one step of its event loop, so a front
# silent this long is stopped or blocked. It counts with its last report and is not asked again until it answers
# a ping; /mmgate/stats and /mmgate/metrics wait at most this long for the slowest front.
REPORT_TIMEOUT = 0.5
# Seconds between two pings of a front that answered: a running gate is heard at least this often, so a front
# that has heard nothing for ``GATE_SILENCE`` knows the gate is silent without asking it.
PING_INTERVAL = 1.0
GATE_SILENCE = 2 * PING_INTERVAL
# Seconds the other fronts have to say which cache entries they hold: a busy front's answer may come later
# than a decode would take, and then the asking front decodes.
PEER_TIMEOUT = 0.5

WireVerdict = list[Any]


# --- front -> gate ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Ready:
    TAG: ClassVar[str] = "ready"


@dataclass(frozen=True, slots=True)
class TakePlace:
    TAG: ClassVar[str] = "place"
    rid: int
    flow: Flow


@dataclass(frozen=True, slots=True)
class Acquire:
    TAG: ClassVar[str] = "acquire"
    rid: int
    cost: int
    timeout: float
    place: int | None  # the place this request held while its body arrived
    tokens: int
    flow: Flow


@dataclass(frozen=True, slots=True)
class Cancel:
    TAG: ClassVar[str] = "cancel"
    rid: int


@dataclass(frozen=True, slots=True)
class Unplace:
    TAG: ClassVar[str] = "unplace"
    place: int


@dataclass(frozen=True, slots=True)
class Release:
    TAG: ClassVar[str] = "release"
    lease: int


@dataclass(frozen=True, slots=True)
class HandedOff:
    TAG: ClassVar[str] = "handed_off"
    lease: int


@dataclass(frozen=True, slots=True)
class Lower:
    """``Lease.lower``: the lease weighs ``cost`` bytes from now on."""

    TAG: ClassVar[str] = "lower"
    lease: int
    cost: int


@dataclass(frozen=True, slots=True)
class Observe:
    """``Gate.observe``: the lease's request completed normally; sent before its ``Release``."""

    TAG: ClassVar[str] = "observe"
    lease: int
    sample: Sample


@dataclass(frozen=True, slots=True)
class Collect:
    TAG: ClassVar[str] = "collect"
    rid: int


@dataclass(frozen=True, slots=True)
class AskCounters:
    TAG: ClassVar[str] = "counters"
    rid: int


@dataclass(frozen=True, slots=True)
class Peek:
    TAG: ClassVar[str] = "peek"
    rid: int
    keys: list[str]  # cache keys, in hex


@dataclass(frozen=True, slots=True)
class Report:
    TAG: ClassVar[str] = "report"
    qid: int
    report: dict[str, Any]  # ``merged_metrics.report_of``


@dataclass(frozen=True, slots=True)
class Found:
    TAG: ClassVar[str] = "found"
    qid: int
    held: dict[str, WireVerdict]  # hex key -> the verdict this front's cache holds


@dataclass(frozen=True, slots=True)
class Pong:
    TAG: ClassVar[str] = "pong"
    qid: int


# --- gate -> front ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Answer:
    """The gate's answer to the front's question ``rid``, with the gate's counters after it."""

    TAG: ClassVar[str]
    rid: int
    counters: GateCounters


@dataclass(frozen=True, slots=True)
class Placed(Answer):
    TAG: ClassVar[str] = "placed"
    place: int


@dataclass(frozen=True, slots=True)
class Admitted(Answer):
    TAG: ClassVar[str] = "admitted"
    lease: int


@dataclass(frozen=True, slots=True)
class Counted(Answer):
    TAG: ClassVar[str] = "counted"


@dataclass(frozen=True, slots=True)
class Collected(Answer):
    TAG: ClassVar[str] = "collected"
    merged: dict[str, Any]  # ``merged_metrics.merge_reports``


@dataclass(frozen=True, slots=True)
class Peeked(Answer):
    TAG: ClassVar[str] = "peeked"
    found: dict[str, WireVerdict]


@dataclass(frozen=True, slots=True)
class Refused(Answer):
    """The gate's refusal, as the registry knows it (a pair it does not know is no message)."""

    TAG: ClassVar[str] = "refused"
    status: int
    code: str
    message: str
    headers: dict[str, str]

    def __post_init__(self) -> None:
        if (self.status, self.code) not in REGISTRY:
            raise ValueError(f"{self.status} {self.code} is not in the error registry")

    @classmethod
    def of(cls, rid: int, error: MmgateError, counters: GateCounters) -> Refused:
        return cls(rid, counters, error.status, error.code, error.message, error.headers)

    def error(self) -> MmgateError:
        return rebuild(self.status, self.code, self.message, headers=self.headers)


@dataclass(frozen=True, slots=True)
class WaitCancelled(Answer):
    TAG: ClassVar[str] = "cancelled"


@dataclass(frozen=True, slots=True)
class AskReport:
    TAG: ClassVar[str] = "ask_report"
    qid: int


@dataclass(frozen=True, slots=True)
class Lookup:
    TAG: ClassVar[str] = "lookup"
    qid: int
    keys: list[str]


@dataclass(frozen=True, slots=True)
class Ping:
    TAG: ClassVar[str] = "ping"
    qid: int


ToGate = (Ready | TakePlace | Acquire | Cancel | Unplace | Release | HandedOff | Lower | Observe | Collect | AskCounters
          | Peek | Report | Found | Pong)
ToFront = Answer | AskReport | Lookup | Ping
Message = ToGate | ToFront
MESSAGES: dict[str, type[Message]] = {
    kind.TAG: kind for kind in (
        Ready, TakePlace, Acquire, Cancel, Unplace, Release, HandedOff, Lower, Observe, Collect, AskCounters, Peek,
        Report, Found, Pong, Placed, Admitted, Counted, Collected, Peeked, Refused, WaitCancelled, AskReport, Lookup,
        Ping)
}
# Fields that travel as arrays of their own fields, by their annotation.
_NESTED: dict[str, Callable[[Any], Any]] = {"Flow": lambda wire: Flow(*wire),
                                            "GateCounters": lambda wire: GateCounters(*wire),
                                            "Sample": lambda wire: Sample(wire[0], tuple(wire[1]))}


def _to_wire(value: Any) -> Any:
    if isinstance(value, Flow):
        return [value.id, value.band, value.client]
    if isinstance(value, GateCounters):
        return list(value)
    if isinstance(value, Sample):
        return [value.seconds, list(value.cls)]
    return value


def encode(sent: Message) -> bytes:
    return orjson.dumps([sent.TAG, *(_to_wire(getattr(sent, field.name)) for field in fields(sent))])


def decode(data: bytes) -> Message:
    """The message ``data`` holds; ValueError or TypeError if it holds none."""
    wire = orjson.loads(data)
    kind = MESSAGES.get(wire[0]) if isinstance(wire, list) and wire and isinstance(wire[0], str) else None
    if kind is None:
        raise ValueError("not a message")
    return kind(*(_NESTED[str(field.type)](value) if str(field.type) in _NESTED else value
                  for field, value in zip(fields(kind), wire[1:], strict=True)))


def verdict_to_wire(verdict: Verdict) -> WireVerdict:
    refusal = verdict.refusal
    return [verdict.size_in, verdict.size_out, verdict.sniffed_mime.decode("latin-1"), verdict.mime.decode("latin-1"),
            verdict.encoded.decode("latin-1") if verdict.encoded is not None else None,
            [refusal.status, refusal.code, refusal.message] if refusal is not None else None,
            list(verdict.video) if verdict.video is not None else None]


def verdict_from_wire(wire: WireVerdict) -> Verdict:
    size_in, size_out, sniffed, mime, encoded, refusal, video = wire
    return Verdict(size_in, size_out, sniffed.encode("latin-1"), mime.encode("latin-1"),
                   encoded.encode("latin-1") if encoded is not None else None,
                   Refusal(*refusal) if refusal is not None else None,
                   (video[0], video[1], video[2]) if video is not None else None)
