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
from typing import Any, ClassVar, TypeVar, dataclass_transform

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
_Kind = TypeVar("_Kind", bound="Tagged")


class Tagged:
    """A message type: ``TAG`` names it on the wire."""

    __slots__ = ()
    TAG: ClassVar[str]


@dataclass_transform(frozen_default=True)
def message(tag: str) -> Callable[[type[_Kind]], type[_Kind]]:
    """Declares a message type: a frozen dataclass with slots, named ``tag`` on the wire."""

    def declare(kind: type[_Kind]) -> type[_Kind]:
        made = dataclass(frozen=True, slots=True)(kind)
        made.TAG = tag
        return made

    return declare


# --- front -> gate ------------------------------------------------------------------------------------------

@message("ready")
class Ready(Tagged):
    """The front listens: it is asked for reports and cache entries from now on."""


@message("place")
class TakePlace(Tagged):
    rid: int
    flow: Flow


@message("acquire")
class Acquire(Tagged):
    rid: int
    cost: int
    timeout: float
    place: int | None  # the place this request held while its body arrived
    tokens: int
    flow: Flow


@message("cancel")
class Cancel(Tagged):
    rid: int


@message("unplace")
class Unplace(Tagged):
    place: int


@message("release")
class Release(Tagged):
    lease: int


@message("handed_off")
class HandedOff(Tagged):
    lease: int


@message("lower")
class Lower(Tagged):
    """``Lease.lower``: the lease weighs ``cost`` bytes from now on."""
    lease: int
    cost: int


@message("observe")
class Observe(Tagged):
    """``Gate.observe``: the lease's request completed normally; sent before its ``Release``."""
    lease: int
    sample: Sample


@message("collect")
class Collect(Tagged):
    rid: int


@message("counters")
class AskCounters(Tagged):
    rid: int


@message("peek")
class Peek(Tagged):
    rid: int
    keys: list[str]  # cache keys, in hex


@message("report")
class Report(Tagged):
    qid: int
    report: dict[str, Any]  # ``merged_metrics.report_of``


@message("found")
class Found(Tagged):
    qid: int
    held: dict[str, WireVerdict]  # hex key -> the verdict this front's cache holds


@message("pong")
class Pong(Tagged):
    qid: int


# --- gate -> front ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Answer(Tagged):
    """The gate's answer to the front's question ``rid``, with the gate's counters after it."""

    rid: int
    counters: GateCounters


@message("placed")
class Placed(Answer):
    place: int


@message("admitted")
class Admitted(Answer):
    lease: int


@message("counted")
class Counted(Answer):
    """The answer to ``AskCounters``: the counters alone."""


@message("collected")
class Collected(Answer):
    merged: dict[str, Any]  # ``merged_metrics.merge_reports``


@message("peeked")
class Peeked(Answer):
    found: dict[str, WireVerdict]


@message("refused")
class Refused(Answer):
    """The gate's refusal, as the registry knows it (a pair it does not know is no message)."""
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


@message("cancelled")
class WaitCancelled(Answer):
    """A wait the front called off, or that ended with the front: no refusal, nobody to tell."""


@message("ask_report")
class AskReport(Tagged):
    qid: int


@message("lookup")
class Lookup(Tagged):
    qid: int
    keys: list[str]


@message("ping")
class Ping(Tagged):
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
