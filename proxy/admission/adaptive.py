"""The adaptive concurrency limit (``MMGATE_MAX_MM_CONCURRENCY=auto``): it probes for the limit at which the
backend completes the most work per second, and gives way when the backend slows down under the same limit.

What it measures. Only normal completions are measured (``sample.Sample``: a 2xx answer relayed to its last byte to
a client that kept reading): the backend's seconds from the hand-off to the last byte, and the request's class
(route, streamed or not, output-token and image buckets). Each class has its own long average of seconds at the
cruise limit, its *reference* (``class_reference``), seeded by the class's first answer at the others' scale (its
seconds over how many times their reference the last answers of known classes took). A completion is worth its
class's reference in *work* (seconds of typical service); its latency is read *normalised*, as its seconds over that
reference. The limit moves in phases of a few rounds of requests. For each the controller takes the *rate*:
completions per second per class by Little's law (``occupancy``: the leases held while each request held its own,
over their seconds: the limit bounds leases, and a slot is held while mmgate prepares the request too, a gap the
backend's own count would not see and that costs a small limit the most), valued in work; the work-weighted median
normalised latency; and whether demand kept the limit full (*busy*: at least half the time every slot was taken or
someone waited). Rates of two phases are compared at one instant, valued with the same references.

What it cannot see. Failed work (errors, refusals, timeouts, aborted and stalled answers) is no sample: an
overload that ends in errors shows only as a lower rate. Requests of one class that cost the backend more or
less than usual (longer prompts, prefix-cache hits, an answer with no usage to a request with no ``max_tokens``)
count at the class's usual worth: a flood of fast answers inside an honest class moves its reference by at most
2/601 a sample, but its work counts, so while it lasts a probe may be kept that should not (the limit may move a
step, and come back once the flood ends). Other gateways' load on the same backend shows only as a lower rate or
a higher latency. It learns only as fast as answers complete: with answers that take minutes, a phase takes
minutes. More classes in turn than ``class_reference.MAX_CLASSES`` evict each other's references.

What it sees of requests still at the backend: their ages (``started`` at the hand-off, ``ended`` when the lease
goes back), a floor under their latency. By Little's law a step whose requests' median time at the backend is
at least *a* delivers at most ``limit × worth / a`` (``_ceiling_rate``; *worth*, the costliest reference of the
mix's classes and of those still completing, ``LIVE``: their classes are not known until they complete, and a
phase may end on a flood of cheap answers alone). A step up that cannot beat what it must, a probe
down that cannot keep what it must, a cruise whose requests are older than the tolerance allows, end at the next
``tick`` without waiting for answers that may not come. A step is judged on its own requests (the last phase's
were admitted under the last limit), a cruise and a probe down on all the backend holds (a probe down counts the
ages of the requests the last phase left from its own start: they are slower because there were more of them).

What it borrows, and from whom:

- TCP BBR (``net/ipv4/tcp_bbr.c``, ``net/ipv4/tcp_rate.c``): rate probing. From ``START`` (4: the smallest fixed
  default; a climb from 1 spent seconds on two doublings) the limit doubles each phase while a doubling grows the
  rate by 60 %, then steps by what a doubling grew it (×4/3 at least: the knee is near, and a backend that collapses
  past it is overshot by a little, not by double), while the rate still grows (BBR's startup and its full-bandwidth
  test, three steps without growth; here a step that loses a twentieth of the best rate ends it at once). Past the
  knee it tries a middle between the best limit and its neighbours (the steps on the way were measured; best as it
  settles, below), measures ``START`` again where its first phase, begun on an idle gate, may be why it loses (the
  clients' first burst can slow everything at once: ``IDLE_SHORTFALL``), and settles on the limit that gave the most
  rate per request at the backend, weighed as Kleinrock's power is, but by a fifth: rate × limit^-``CROWD_COST`` at
  the lower bound of one standard error (a doubling must add 15 % of rate to be worth twice the requests; on a
  plateau, where more requests only wait longer, the smallest limit on it wins, whatever the noise, where "the
  smallest limit with 95 % of the best rate" chose among the plateau's limits by which read highest). When it
  settles below the limit in force, it cruises there first: the backend drains the requests the higher limit left
  before a probe down is judged. Then it cycles through eight phases, one up (×1.25), one down, six cruising, from a
  random phase (``bbr_cycle_rand``) so that replicas do not probe in step. A probe up is kept if the rate grew 10 %
  by one standard error of its rate (a real server's phases differ by several per cent alone: on a plateau, a
  smaller gain, or one read on few answers, is noise that would walk the limit up), and the climb goes on; a probe
  down if the rate held 95 % of the best lately (so that steps down cannot add up) by one standard error of its rate
  (``spread_of``: on a plateau, a probe down that kept the rate by luck would walk the limit down). So a batching
  server, whose latency grows with its batch while its rate still does, is climbed, and a thrashing one held at its
  knee. Two probes up in a row that raise the rate in proportion to the slots start doubling again. A phase is
  judged on requests admitted in it and handed off once the backend holds its load (BBR's round), each a rate
  sample. A probe down that kept the rate is followed by the next at once, as a climb is; with nothing tried below
  the limit startup settled on (a backend whose best is under ``START``), the cycle opens on its probe down. Not
  taken: BBR's delivery-rate samples (``occupancy`` says why); its limit of rate × minimum latency, which
  under-shoots a batching server, whose rate grows with its batch; its probe of the minimum latency; its drain gain
  of 3/4 (here 7/8: a probe down that loses costs a round).
- Envoy's adaptive concurrency filter (gradient controller): the median of a phase's latencies; samples of
  requests admitted under another limit judge nothing (Envoy drops those started before its minRTT window);
  five busy phases at the floor force a probe up (Envoy re-measures after five windows at its minimum); no cut
  is deeper than half. Not taken: pinning the limit low every minute to re-measure the minimum latency.
- Netflix concurrency-limits' ``Gradient2Limit``: the per-class reference is its long exponential average
  (``class_reference``); its tolerance of 1.5: a cruise phase whose latency exceeds both the last phases' and the
  references by half again is the backend slowing down (other work on it, or it changed), and the limit gives
  way in proportion, then narrows the knee down again between a quarter below the cut and the old limit, now
  known to be too high (a cruise whose rate fell by a quarter while its latency grew a fifth does the same: the
  knee moved below the limit); a phase
  that did not keep the limit full raises nothing (the app-limited rule). Not taken: growth
  by a fixed queue size per window, and the drift of its long average (``class_reference`` says why).
- TCP congestion window validation (RFC 7661): a limit that demand did not fill for a whole phase comes down to
  what demand used, so a burst (or an attack's extra connections) cannot leave it high; when more demand than that
  comes back within the non-validated period (five minutes), so does the limit it had, at once (it was measured).
  Startup that has measured nothing yet (a lone warm-up request) waits for demand instead of ending.

The controller is arithmetic on the event loop, with an injected clock and random generator. ``Gate`` calls
``load`` on every change of its counters, ``granted`` and ``given_back`` around each lease, ``started`` and
``ended`` around each request's time at the backend,
``tick`` every ``TICK_S`` and ``observe`` once per normal completion; ``load``, ``tick`` and ``observe`` return
whether ``limit`` changed. ``explain`` says where it stands and why the limit last moved: each of the last
``MOVES_KEPT`` changes with its reason and what the phase before it had measured (``Move``).
"""

from __future__ import annotations

import math
import random
import statistics
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from proxy.admission.class_reference import References
from proxy.admission.occupancy import Occupancy
from proxy.admission.sample import Sample, SampleClass

Kind = Literal["startup", "up", "down", "cruise"]
Mix = dict[SampleClass, float]  # completions per second of each class


class Busy(NamedTuple):
    """A phase demand kept full: its mix and median normalised latency (judged on two samples at least)."""

    mix: Mix
    latency: float


class AppLimited(NamedTuple):
    """A phase demand did not fill, judged on that alone: its mix and median normalised latency, None when
    nothing completed."""

    mix: Mix
    latency: float | None


Measured = Busy | AppLimited


class Tried(NamedTuple):
    """What startup measured at one limit: a busy phase's mix and median normalised latency, its rate's standard
    error as a share of it, and whether the phase began on an idle gate."""

    mix: Mix
    latency: float
    spread: float
    from_idle: bool

FULL_GROWTH = 1.25  # BBR bbr_full_bw_thresh: a doubling that adds less (a smaller step: by its log) is no growth ...
FULL_COUNT = 3  # ... and this many of them end startup (BBR bbr_full_bw_cnt)
# Startup: middles tried between the best limit and its neighbours at most, from a cold start (the steps to the
# knee were measured on the way: one middle is worth its cost) and after giving way (three: where the knee moved
# is not known) ...
COLD_NARROW_STEPS, NARROW_STEPS = 1, 3
BELOW = 0.75  # ... or this share of a best limit with none tried below it
FALLEN = 0.95  # startup: a step whose rate is under this share of the best is past the knee
IDLE_SHORTFALL = 0.3  # a phase begun on an idle gate may read this share under its limit's rate (see ``_finish``)
CROWD_COST = 0.2  # startup settles on the most rate × limit^-CROWD_COST: a doubling must add 15 % to be worth it ...
MAX_SPREAD = 0.5  # ... each at its rate less one standard error, this share at most (a phase of one sample: this)
DOUBLING_GROWTH = 1.6  # startup doubles while a doubling grows the rate this much ...
STARTUP_GAIN = 1.33  # ... else it steps by what a doubling grew it, at least this (a third: the knee is near)
START = 4  # where a cold start begins: the smallest fixed default, so the climb from the floor is two steps shorter
UP_GAIN, DOWN_GAIN = 1.25, 0.875  # BBR bbr_pacing_gain is 5/4 up, 3/4 down: see the module's docstring
CYCLE: tuple[Kind, ...] = ("up", "down", *("cruise",) * 6)  # BBR: CYCLE_LEN 8, up, drain, six cruising
CYCLE_RAND = 7  # BBR bbr_cycle_rand: the cycle starts at one of this many phases, never at the probe down
GROW_MIN = 0.1  # a probe up is kept when the rate grew this much ...
KEEP_DOWN = 0.95  # ... a probe down when the rate held this much
PROPORTIONAL = 0.8  # two probes up in a row that raise the rate by this share of the slots added: doubling again
TOLERANCE = 1.5  # Gradient2Limit rttTolerance: latency this many times the usual is the backend slowing down
FELL = 0.75  # a cruise phase whose rate is under this share of the cruise rate ...
GREW = 1.2  # ... while its latency grew this much: the backend changed
STUCK = 3.0  # a probe down gives way when the requests at the backend are this many times the usual latency
MIN_GRADIENT = 0.5  # Gradient2Limit and Envoy: no one cut deeper than this
BUSY_SHARE = 0.5  # Gradient2Limit: under half-full is app-limited (there: inflight < limit / 2)
FLOOR_PHASES = 5  # Envoy: this many windows at the minimum force a new measurement
NON_VALIDATED_S = 300.0  # RFC 7661's non-validated period: how long a limit lowered for want of demand comes back
STARTUP_SAMPLES, PHASE_SAMPLES = 2, 8  # a phase needs max(this, 1 or 2 × its limit) samples (BBR: 1 or 2 rounds)
EARLY_SAMPLES = 4  # a probe down that loses already is ended after this many
PHASE_MIN_S = 0.2  # BBR bbr_probe_rtt_mode_ms is 200 ms: no phase judged on less
PHASE_MAX_S = 30.0  # a phase still short of samples is judged on what it has after this long ...
PHASE_MAX_ROUNDS = 8  # ... or after this many of its longest requests, when they take longer
MAX_LATENCIES = 100_000  # latencies a phase keeps at most (a flood of tiny answers cannot grow it without bound)
SMOOTHING = 0.5  # the cruise latency: the average of the last phases, each weighing half
TINY = 1e-6  # seconds: a sample's smallest worth (a zero would weigh nothing and divide by zero)
MAX_TIMED = 1024  # a phase's completions whose seconds are kept for ``_Phase.median_at_least``, at most
CONFIDENCE = 1.0  # standard errors by which a probe down's rate must clear what it keeps, to be kept
MOVES_KEPT = 64  # the last changes of the limit ``explain`` tells
LIVE = 2.0  # a class counts as still at the backend for this many times its reference after it last completed
TICK_S = 0.1  # how often the gate asks ``tick`` to look at the requests still in flight
RECENT = 8  # the completions of known classes a new class's first seconds are read against


@dataclass(frozen=True)
class Move:
    """One change of the limit, and why: what the phase that ended had measured."""

    at: float  # the controller's clock
    limit: int  # the limit from here on ...
    before: int  # ... and before
    cruise_limit: int
    mode: Literal["startup", "probe"]
    kind: Kind  # the phase that begins
    why: str  # what decided it, in words
    samples: float  # the ended phase's effective number of rate samples
    rate: float | None  # its work per second, with the references of the moment ...
    spread: float | None  # ... and that rate's standard error, as a share of it (None under two samples)
    latency: float | None  # its median normalised latency
    at_least: float | None  # the floor under its median seconds at the backend (a phase ended on ages)

    def as_dict(self) -> dict[str, object]:
        return {"at": self.at, "limit": self.limit, "before": self.before, "cruise_limit": self.cruise_limit,
                "mode": self.mode, "kind": self.kind, "why": self.why, "samples": round(self.samples, 1),
                "rate": self.rate, "spread": self.spread, "latency": self.latency, "at_least": self.at_least}


@dataclass
class _Phase:
    """What one phase has measured so far."""

    started_at: float
    peak: int  # the most leases held and waiting at once
    busy_seconds: float = 0.0
    settled_at: float | None = None  # when its first request completed: the backend holds its load from here
    weight: float = 0.0  # the work of its rate samples ...
    weight_squared: float = 0.0  # ... and its square (for Kish's effective number of samples)
    held: dict[SampleClass, float] = field(default_factory=dict)  # per class, its rate samples' mean leases held
    held_seconds: float = 0.0  # the seconds of every rate sample's lease
    latencies: list[tuple[float, float]] = field(default_factory=list)  # (normalised latency, work)
    seconds: dict[SampleClass, list[float]] = field(default_factory=dict)  # cruise: each class's seconds
    longest: float = 0.0  # its longest request, in seconds
    from_idle: bool = False  # its first demand found the gate idle (at start, after a lull)
    lower: bool = False  # its limit is below the last phase's ...
    crowd: int = 0  # ... and the requests the backend held when it began
    timed: list[float] = field(default_factory=list)  # the seconds of its first completions (``MAX_TIMED``)
    rated: list[tuple[SampleClass, float, float]] = field(default_factory=list)  # (class, held, seconds) of its
    # first rate samples (``MAX_TIMED``): the spread of its rate
    in_flight: list[float] = field(default_factory=list)  # when each of its requests at the backend now went

    def mix(self) -> Mix:
        """Completions per second per class, by Little's law (``occupancy``): the mean leases held while each of
        the class's rate samples held its own, summed, over the seconds of every sample's lease."""
        return {cls: held / self.held_seconds for cls, held in self.held.items()} if self.held_seconds else {}

    def median_at_least(self, ages: list[float]) -> float | None:
        """A floor under the median time at the backend of its requests, given the ages of the requests at the
        backend now (ascending): the median of its completions' times and those ages (an age only grows), or,
        when larger, the median age alone (answers that stopped coming, behind many that came before). None
        with neither."""
        times = sorted(self.timed + ages)
        if not times:
            return None
        return max(times[(len(times) - 1) // 2], ages[(len(ages) - 1) // 2] if ages else 0.0)

    def effective(self) -> float:
        """Its rate samples as an effective number (Kish's, weighing each by its work): answers worth a
        thousandth of the others' barely count, so they cannot cut a phase short."""
        return self.weight * self.weight / self.weight_squared if self.weight_squared else 0.0


class AdaptiveLimit:
    """Finds the concurrency limit between ``floor`` and ``ceiling`` at which the backend delivers the most
    work, by probing it. ``limit`` is the current phase's; ``cruise_limit`` the one it returns to between
    probes."""

    def __init__(self, floor: int, ceiling: int, initial: int | None = None,
                 clock: Callable[[], float] = time.monotonic, rng: random.Random | None = None) -> None:
        self.floor = floor
        self.ceiling = ceiling
        self._clock = clock
        self._rng = rng if rng is not None else random.Random()
        self.cruise_limit = self._bounded(initial if initial is not None else floor)
        self.limit = self.cruise_limit
        self.mode: Literal["startup", "probe"] = "startup"
        self.kind: Kind = "startup"
        self.phase = 0  # bumped at every phase: a lease carries the phase it was admitted in
        self.references = References()
        self.mix: Mix | None = None  # the cruise limit's completions per second, per class
        self._top: Mix | None = None  # the best mix lately at or above the cruise limit: what a probe down keeps
        self.latency: float | None = None  # the cruise limit's median normalised latency
        self.samples = 0  # normal completions observed
        self._table: dict[int, Tried] = {}  # startup: what each limit measured
        self._last_step: tuple[int, float] | None = None  # startup: the last limit that grew, and its rate
        self._lost: set[int] = set()  # startup: limits cut short, their rate plainly below the best
        self._narrowing = False  # startup: past the knee, narrowing it down
        self._narrowed = 0
        self._narrow_steps = COLD_NARROW_STEPS
        self._opening = False  # the cycle opened on a probe down, and goes on from a random phase after it
        self._provisional = False  # the cruise latency is startup's, not yet a cruise phase's
        self._validated: tuple[int, float] | None = None  # a limit lowered for want of demand, and when
        self._no_growth = 0
        self._index = 0  # the phase's place in CYCLE
        self._ups = 0  # probes up in a row that raised the rate in proportion
        self._floor_phases = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=RECENT)  # known classes' last (normalised, work)
        self._at_backend: list[float] = []  # when each request at the backend now was handed off (ascending)
        self._held: list[float] = []  # when each lease held now was granted (ascending)
        self._in_use = self._waiting = 0
        self.moves: deque[Move] = deque(maxlen=MOVES_KEPT)  # the last changes of the limit, and why
        self._why = "the start, before any sample"
        self._evidence: tuple[float, float | None, float | None, float | None, float | None] = (
            0.0, None, None, None, None)
        now = clock()
        self._leases = Occupancy(now)  # the leases held: what the limit bounds
        self._last_at = now
        self._last_busy = False
        self._longest_before = 0.0  # the last phase's longest request
        self._now = _Phase(now, 0)
        self._begin(now, "startup")

    def _bounded(self, limit: int) -> int:
        return max(self.floor, min(self.ceiling, limit))

    def _up(self, limit: int) -> int:
        # rounded down: from 7, ×1.25 rounded is 9, and a knee at 8 would never be tried
        return self._bounded(max(limit + 1, int(UP_GAIN * limit)))

    def _down(self, limit: int) -> int:
        return self._bounded(min(limit - 1, round(DOWN_GAIN * limit)))

    def rate_of(self, mix: Mix) -> float:
        """The work per second of ``mix``: each class's completions per second times its reference."""
        return sum(per_second * self.references.value(cls) for cls, per_second in mix.items())

    def spread_of(self, phase: _Phase) -> float:
        """The standard error of ``phase``'s rate as a share of it (a ratio estimator's: its samples' work held over
        their seconds); infinite with fewer than two samples."""
        pairs = [(held * self.references.value(cls), seconds) for cls, held, seconds in phase.rated]
        count = len(pairs)
        work = sum(y for y, _x in pairs)
        seconds = sum(x for _y, x in pairs)
        if count < 2 or work <= 0 or seconds <= 0:
            return math.inf
        ratio = work / seconds
        residuals = sum((y - ratio * x) ** 2 for y, x in pairs) / (count - 1)
        return math.sqrt(residuals / count) / (seconds / count) / ratio

    @property
    def rate(self) -> float | None:
        """The cruise limit's work per second (seconds of typical service completed per second), as of now."""
        return self.rate_of(self.mix) if self.mix is not None else None

    def explain(self) -> dict[str, object]:
        """What ``/mmgate/stats`` shows of it: the limit, the phase it is in, and the last changes of the limit
        with why each was made and what the phase before it had measured."""
        return {"limit": self.limit, "cruise_limit": self.cruise_limit, "mode": self.mode, "phase": self.kind,
                "rate": self.rate, "latency": self.latency, "samples": self.samples,
                "moves": [move.as_dict() for move in self.moves]}

    # --- what the gate reports ---------------------------------------------------------------------------------

    def load(self, in_use: int, waiting: int) -> bool:
        """The gate's counters changed: ``in_use`` leases held, ``waiting`` in line. Returns whether ``limit``
        changed (a phase that ran out of time ends here)."""
        now = self._clock()
        self._account(now)
        self._in_use, self._waiting = in_use, waiting
        self._last_busy = self._busy_now()
        phase = self._now
        if not phase.peak and in_use + waiting:
            # Its first demand: a phase begun on an idle gate (at start, after a lull) is measured from here, so
            # the wait for traffic does not read as demand that left the limit unfilled.
            phase.started_at, phase.busy_seconds, phase.from_idle = now, 0.0, True
        phase.peak = max(phase.peak, in_use + waiting)
        self._settle_down(now)
        validated = self._validated
        if validated is not None and waiting and in_use + waiting > self.cruise_limit:
            self._validated = None
            return self._demand_is_back(now, *validated)
        return self._out_of_time(now) and self._end(now)

    def _demand_is_back(self, now: float, limit: int, lowered_at: float) -> bool:
        """RFC 7661: demand is more than a limit lowered for want of it (requests wait, and more than the limit
        arrived): the limit it had comes back at once (measured before, it is known to pay), unless that was longer
        ago than the non-validated period."""
        if now - lowered_at > NON_VALIDATED_S or limit <= self.cruise_limit or self.mode != "probe":
            return False
        before = self.limit
        self.cruise_limit = limit
        self._cruise_on(None, None)
        self._why = f"demand is back: the limit it had, {limit}"
        self._index = len(CYCLE) - 1  # a cruise at it first: measured before a probe moves it
        self._begin(now, "cruise")
        return self.limit != before

    def tick(self) -> bool:
        """The gate calls this every ``TICK_S``: a phase that ran out of time, or whose requests have been at
        the backend so long that its rate cannot reach what it must, ends here, whether or not anything
        completes (a controller that learnt only from completions would see nothing while nothing completes).
        Returns whether ``limit`` changed."""
        now = self._clock()
        if not self._now.peak:  # no demand yet: nothing to judge, however long it waits
            return False
        if self._out_of_time(now):
            return self._end(now)
        return self._overdue(now) and self._cut_short(now)

    def _out_of_time(self, now: float) -> bool:
        phase = self._now
        return now - phase.started_at >= max(PHASE_MAX_S, PHASE_MAX_ROUNDS * max(phase.longest, self._longest_before))

    def granted(self) -> float:
        """A lease was granted: returns when (pass it to ``observe`` and ``given_back``)."""
        now = self._clock()
        self._held.append(now)  # the clock does not go back: still ascending
        self._leases.change(now, len(self._held), self._held[0])
        return now

    def given_back(self, granted_at: float) -> None:
        """The lease ``granted`` returned ``granted_at`` for was given back, however its request ended."""
        _forget(self._held, granted_at)
        now = self._clock()
        self._leases.change(now, len(self._held), self._held[0] if self._held else now)

    def started(self, phase: int) -> float:
        """A request admitted in ``phase`` was handed to the backend: returns when (pass it to ``ended``)."""
        now = self._clock()
        self._at_backend.append(now)  # the clock does not go back: still ascending
        if phase == self.phase:
            self._now.in_flight.append(now)
        return now

    def ended(self, phase: int, started_at: float) -> None:
        """The request ``started`` returned ``started_at`` for left the backend, however it ended."""
        _forget(self._at_backend, started_at)
        if phase == self.phase:
            _forget(self._now.in_flight, started_at)

    def observe(self, sample: Sample, phase: int, granted_at: float) -> bool:
        """One normal completion; ``phase`` is ``self.phase`` when its request was admitted, ``granted_at`` what
        ``granted`` returned for its lease. Returns whether ``limit`` changed."""
        now = self._clock()
        self.samples += 1
        known = self.references.value(sample.cls)
        if known:
            self._recent.append((sample.seconds / known, known))
        if phase != self.phase:  # Envoy's rule: admitted under another limit, it says nothing about this one
            self.references.completed(sample.cls, now)  # but its class is still at the backend
            return False
        self.references.completed(sample.cls, now)
        reference = self.references.get(sample.cls)
        current = self._now
        if not reference.count:
            # A new class's first sample seeds it, whatever the phase, at the scale of the others: its seconds over
            # how many times their reference the known classes take now. Seeded as it came, a class first seen at
            # a higher limit would be worth more than one seen at a lower, for no more work, and that phase's rate
            # would read higher by as much (the real vLLM's answers of 15 and 16 tokens are two classes).
            reference.add(sample.seconds / self._load_now())
        work = max(TINY, reference.value)
        if len(current.latencies) < MAX_LATENCIES:
            current.latencies.append((sample.seconds / work, work))
            if self.kind == "cruise":
                current.seconds.setdefault(sample.cls, []).append(sample.seconds)
        current.longest = max(current.longest, sample.seconds)
        if len(current.timed) < MAX_TIMED:
            current.timed.append(sample.seconds)
        if current.settled_at is None:
            current.settled_at = now
        timely = now - current.started_at >= PHASE_MIN_S
        if self.kind == "startup" and timely and not self._filled(now):
            return self._end(now)  # a doubling that demand does not fill: startup is over, no need to wait
        if now - sample.seconds < current.settled_at or sample.seconds <= 0:
            # In flight while the phase's first requests were: the backend still held the last phase's
            # requests. Its latency counts, its rate does not (BBR judges a gain after a round at it).
            return False
        # Its lease's time, not only the backend's: a slot is also held while mmgate prepares the request, and a
        # rate read at the backend alone would not see those gaps, which cost a small limit the most. At least
        # itself: its lease was held all along.
        seconds = max(sample.seconds, now - granted_at)
        held = max(1.0, self._leases.mean(now - seconds, now))
        current.held[sample.cls] = current.held.get(sample.cls, 0.0) + held
        current.held_seconds += seconds
        if len(current.rated) < MAX_TIMED:
            current.rated.append((sample.cls, held, seconds))
        current.weight += work
        current.weight_squared += work * work
        if timely and (current.effective() >= self._need() or (
                current.effective() >= EARLY_SAMPLES and self._losing_down())):
            return self._end(now)
        return False

    # --- phases ------------------------------------------------------------------------------------------------

    def _load_now(self) -> float:
        """How many times their reference the last completions of known classes took (``RECENT`` of them, the
        work-weighted median: a flood of cheap answers barely weighs); 1 before any."""
        return max(TINY, weighted_median(list(self._recent)) or 1.0)

    def _ceiling_rate(self, now: float, compared: Mix | None) -> float | None:
        """The most work per second the phase can still show, by Little's law: ``limit`` requests at once, none
        back sooner than the floor under its median time in flight, each worth at most the costliest class of
        ``compared`` (the classes of requests in flight are not known yet; a flood of cheap answers in the mix
        must not make honest ones look overdue). None when the phase has no such floor, or when demand does not
        fill its limit (demand, not the backend, is what holds its rate down)."""
        since = self._now.in_flight  # a step up is judged on its own requests: the last phase's had the last limit
        at_least = self._now.median_at_least([now - started for started in reversed(since)])
        if at_least is None or at_least <= 0 or not compared or not self._filled(now):
            return None
        return self.limit * self._worth(now, compared) / at_least

    def _overdue(self, now: float) -> bool:
        """Whether the requests at the backend already show that the phase cannot do what it is for: a step of
        startup or a probe up that cannot beat the rate it must beat, or a cruise whose latency is past the
        tolerance, a probe whose is far past it (the backend slowed down, and nothing completes to say so)."""
        if self._stuck(now) is not None:
            return True
        if self.kind == "startup":
            rates = self._rates()
            if not rates:
                return False
            best = max(rates, key=lambda limit: rates[limit])
            ceiling = self._ceiling_rate(now, self._table[best].mix)
            # Below the best limit it need only beat it per request at the backend, as startup settles.
            fewer = (best / self.limit) ** CROWD_COST if self.limit < best else 1.0
            return ceiling is not None and ceiling * fewer < FALLEN * rates[best]
        if self.kind == "up" and self.mix is not None:
            ceiling = self._ceiling_rate(now, self.mix)
            return ceiling is not None and ceiling < (1 + GROW_MIN) * self.rate_of(self.mix)
        return False

    def _stuck(self, now: float) -> float | None:
        """How many times their usual latency the requests at the backend take (``_slower``) when that is past the
        tolerance (cruise) or far past it (a probe: a probe down holds what the probe up before it left there, and
        a probe up's own requests take longer); None when they are not stuck, and in startup."""
        if self.kind == "startup":
            return None
        slower = self._slower(now)
        if slower is None or slower <= self._tolerance():
            return None
        return slower

    def _tolerance(self) -> float:
        """How many times their usual latency this phase's requests may take before the limit gives way: the
        tolerance in a cruise; far past it (``STUCK``) in a probe, and while the usual latency is startup's."""
        return TOLERANCE if self.kind == "cruise" and not self._provisional else STUCK

    def _slower(self, now: float) -> float | None:
        """How many times its usual latency the floor under the cruise phase's median latency is: the usual is
        the larger of the cruise latency and the classes' references, as for a cruise phase that completed (so
        that a flood of fast answers, which lowers the former, does not make honest answers after it look late)."""
        if self.mix is None or self.latency is None:
            return None
        # A phase below the last one holds the last one's requests, slower because there were more of them: their
        # time counts from its start, and while they drain each takes as much longer as the backend held more
        # requests than this limit (Little's law: a phase that follows startup's climb to 13 down to 4 drains 13).
        since = self._now.started_at if self._now.lower else 0.0
        at_least = self._now.median_at_least([now - max(started, since) for started in reversed(self._at_backend)])
        if at_least is None:
            return None
        crowded = max(1.0, self._now.crowd / self.limit) if self._now.lower else 1.0
        return at_least / crowded / max(TINY, self._worth(now, self.mix)) / max(1.0, self.latency)

    def _worth(self, now: float, mix: Mix) -> float:
        """The most a request at the backend may be worth: the costliest class of ``mix``, or of the classes
        still completing (``LIVE``). A phase may end on a flood of cheap answers alone, before any request of
        an honest class admitted in it could complete; weighed at the cheap class, the honest requests still
        at the backend would look hundreds of times late."""
        return max(max(self.references.value(cls) for cls in mix), self.references.costliest_live(now, LIVE))

    def _cut_short(self, now: float) -> bool:
        """End an overdue phase without waiting for its answers: startup is past the knee, the probe up lost, or
        the limit gives way in proportion to how late the requests at the backend are (no deeper than half)."""
        before = self.limit
        slower = self._stuck(now)
        ages = self._at_backend if slower is not None else self._now.in_flight
        self._evidence = (self._now.effective(), None, None, None,
                          self._now.median_at_least([now - started for started in reversed(ages)]))
        if self.kind == "startup":
            self._why = f"startup: its requests at the backend are too old for {self.limit} to beat the best rate"
            self._lost.add(self.cruise_limit)
            kind = self._narrow()
        elif slower is None:  # a probe up (a cruise or a probe down is overdue only when stuck)
            self._why = "probe up lost: its requests at the backend are too old for it to pay"
            self._ups = 0
            kind = self._next_in_cycle()
        else:
            self._why = f"{self.kind}: its requests at the backend are {slower:.2f}× the usual latency; giving way"
            kind = self._give_way(1 / slower)
        self._begin(now, kind)
        return self.limit != before

    def _need(self) -> float:
        if self.kind == "startup":
            return max(STARTUP_SAMPLES, self.limit)
        return max(PHASE_SAMPLES, 2 * self.limit)

    def _losing_down(self) -> bool:
        """A probe down whose rate is already short: going on with it only costs."""
        return self.kind == "down" and self.rate_of(self._now.mix()) < KEEP_DOWN * self._to_keep()

    def _to_keep(self) -> float:
        """The rate a probe down must keep 95 % of: the best lately, not the last step's, so that steps down of
        4 % each cannot add up."""
        return max(self.rate or 0.0, self.rate_of(self._top) if self._top is not None else 0.0)

    def _cruise_on(self, mix: Mix | None, latency: float | None) -> None:
        self.mix, self.latency = mix, latency
        if mix is None:
            self._top = None
        elif self._top is None or self.rate_of(mix) > self.rate_of(self._top):
            self._top = mix

    def _busy_now(self) -> bool:
        return self._in_use >= self.limit or self._waiting > 0

    def _account(self, now: float) -> None:
        if self._last_busy:
            self._now.busy_seconds += now - self._last_at
        self._last_at = now

    def _filled(self, now: float) -> bool:
        """Whether demand kept the limit full (every slot taken, or someone waiting) half the phase so far."""
        self._account(now)
        elapsed = now - self._now.started_at
        return elapsed > 0 and self._now.busy_seconds / elapsed >= BUSY_SHARE

    def _begin(self, now: float, kind: Kind) -> None:
        self.phase += 1
        self.kind = kind
        limit, before = self.cruise_limit, self.limit
        self.limit = self._up(limit) if kind == "up" else self._down(limit) if kind == "down" else limit
        self._longest_before = self._now.longest
        self._now = _Phase(now, self._in_use + self._waiting, lower=self.limit < before, crowd=len(self._at_backend))
        if self.limit != before or not self.moves:
            self.moves.append(Move(now, self.limit, before, self.cruise_limit, self.mode, kind, self._why,
                                   *self._evidence))
        self._last_busy = self._busy_now()
        self._settle_down(now)

    def _settle_down(self, now: float) -> None:
        """A phase below the last one (a probe down, a narrowing step) holds its load as soon as the backend
        holds no more than its limit: what is handed off from then on measures it (a phase above needs its own
        first request back: the backend's batch grew)."""
        if self._now.lower and self._now.settled_at is None and self._in_use <= self.limit:
            self._now.settled_at = now

    def _measured(self, now: float) -> Measured | None:
        """What the phase measured, or None when too little was measured to judge a busy phase (an
        app-limited one needs nothing measured: it is judged on that alone)."""
        current = self._now
        latency = weighted_median(current.latencies)
        if not self._filled(now):
            return AppLimited(current.mix(), latency)
        if latency is None or len(current.latencies) < 2 or not current.weight:
            return None
        return Busy(current.mix(), latency)

    def _end(self, now: float) -> bool:
        before = self.limit
        measured = self._measured(now)
        spread = self.spread_of(self._now)
        self._evidence = (self._now.effective(), self.rate_of(self._now.mix()) if self._now.weight else None,
                          spread if math.isfinite(spread) else None, weighted_median(self._now.latencies), None)
        for cls, seconds in self._now.seconds.items():
            # Learnt at the cruise limit, one value a phase (Gradient2 takes one a window): probes and startup's
            # doublings are measured against it, and a flood of answers in one phase is one value.
            self.references.get(cls).add(statistics.median(seconds))
        kind = self._after_startup(measured, spread) if self.mode == "startup" else self._after_probe(measured, spread)
        self._begin(now, kind)
        return self.limit != before

    def _after_startup(self, measured: Measured | None, spread: float) -> Kind:
        """BBR's startup: grow while the rate grows; stop when it stops growing, when it falls, or when demand
        does not fill the limit (then demand, not the backend, is what caps the rate). The limit doubles while
        the rate grows in proportion; once it grows less, each step multiplies the limit by what a doubling
        multiplied the rate by lately (between ×1.25 and ×2): a backend whose gains dwindle toward its knee is
        stepped over it by a little, not by double. Then the knee is narrowed down."""
        if measured is None:
            return "startup"
        if isinstance(measured, AppLimited):
            if not self._table and not self._narrowing:  # nothing measured yet: startup waits for demand
                self._why = "startup: demand did not fill the limit yet"
                return "startup"
            self._why = "demand did not fill the limit"
            return self._finish()
        mix, latency = measured
        limit = self.cruise_limit
        best = max(self._rates().values(), default=0.0)
        self._table[limit] = Tried(mix, latency, spread, self._now.from_idle)
        if self._narrowing:
            self._why = f"startup: {limit} measured"
            return self._narrow()
        rate = self.rate_of(mix)
        last = self._last_step
        step = limit / last[0] if last is not None else 2.0
        if best and rate < FALLEN * best:  # past the knee (a little less than the best is no growth)
            self._why = f"startup: {limit} is past the knee (rate {rate / best:.2f}× the best)"
            return self._narrow()
        if best and rate < best * (1 + (FULL_GROWTH - 1) * math.log2(max(step, 1.0))):
            self._no_growth += 1
            if self._no_growth >= FULL_COUNT:
                self._why = f"startup: the rate stopped growing ({FULL_COUNT} steps)"
                return self._narrow()
        else:
            self._no_growth = 0
        if limit >= self.ceiling:
            self._why = "startup: at the ceiling"
            return self._narrow()
        gain = 2.0
        if last is not None and last[1] and step > 1:
            per_doubling = (rate / last[1]) ** (1 / math.log2(step))
            if per_doubling < DOUBLING_GROWTH:  # the gains dwindle: the knee is near
                gain = min(2.0, max(STARTUP_GAIN, per_doubling))
        self._last_step = (limit, rate)
        self.cruise_limit = self._bounded(max(limit + 1, round(limit * gain)))
        self._why = f"startup: the rate grew ×{rate / last[1]:.2f} at {limit}" if last is not None and last[1] else (
            "startup: the first step")
        return "startup"

    def _give_way(self, share: float) -> Kind:
        """The backend slowed down under the same limit (other work on it, or it changed): the limit gives way
        in proportion to how much slower (no deeper than half), then startup narrows the knee down again from
        there, the old limit counted as too high: a quarter below the cut and halfway back up are tried (a
        backend uniformly slower has its knee where it had, one whose knee moved has it lower: measuring each
        beats guessing which)."""
        before = self.cruise_limit
        self.cruise_limit = self._bounded(int(before * max(MIN_GRADIENT, share)))
        self._cruise_on(None, None)
        if self.cruise_limit == before:  # at the floor already: nothing below to search
            return self._next_in_cycle()
        self.mode, self._no_growth, self._last_step = "startup", 0, None
        self._narrowing, self._narrowed, self._lost, self._narrow_steps = True, 0, {before}, NARROW_STEPS
        return "startup"

    def _rates(self) -> dict[int, float]:
        return {limit: self.rate_of(tried.mix) for limit, tried in self._table.items()}

    def _worth_settling(self, limit: int, rate: float) -> float:
        """What startup settles by: ``limit``'s ``rate`` less its standard error, over ``limit ** CROWD_COST``."""
        return rate * (1 - CONFIDENCE * min(MAX_SPREAD, self._table[limit].spread)) * limit ** -CROWD_COST

    def _narrow(self) -> Kind:
        """Between the best limit startup tried and its tried neighbours, try the middle of the wider gap (a
        search in halves), up to ``NARROW_STEPS`` times: a thrashing knee at 6 between 4 and 8 is found in two
        phases. A best limit with none tried below it (a search begun where the limit gave way) has a quarter
        less tried below it. Then startup is over."""
        self._narrowing = True
        rates = self._rates()
        if not rates or self._narrowed >= self._narrow_steps:
            return self._finish()
        best = max(rates, key=lambda limit: (self._worth_settling(limit, rates[limit]), -limit))
        tried = set(rates) | self._lost
        below = max((limit for limit in tried if limit < best), default=None)
        above = min((limit for limit in tried if limit > best), default=None)
        gaps: list[tuple[int, int]] = []  # (the gap, its middle)
        if below is not None:
            gaps.append((best - below, (below + best + 1) // 2))
        elif best > self.floor:
            gaps.append((best - self.floor, max(self.floor, min(best - 1, round(best * BELOW)))))
        if above is not None:
            gaps.append((above - best, (best + above) // 2))
        gaps = [(gap, middle) for gap, middle in gaps if (gap > 1 or below is None) and middle not in tried]
        if not gaps:
            return self._finish()
        self._narrowed += 1
        self.cruise_limit = max(gaps, key=lambda gap: (gap[0], -gap[1]))[1]  # a tie: the lower, cheaper to lose
        self._why += f"; narrowing the knee around the best so far, {best}"
        return "startup"

    def _finish(self) -> Kind:
        """Startup is over: cruise at the limit whose rate, less its standard error, over ``limit ** CROWD_COST``
        is the most (the module's docstring says why), unless a limit read on an idle gate is measured again
        first (``_again``)."""
        self._opening = False
        if self._table:
            rates = self._rates()
            best = max(rates, key=lambda limit: (self._worth_settling(limit, rates[limit]), -limit))
            again = self._again(rates, best)
            if again is not None:
                self.cruise_limit, self._narrowing = again, True
                self._why += f"; {again} measured again (its phase began on an idle gate)"
                return "startup"
            self.cruise_limit = best
            self._opening = best > self.floor and all(limit >= best for limit in set(rates) | self._lost)
            self._why += "; startup over: the most rate per request at the backend"
            self._top = max((tried.mix for tried in self._table.values()), key=self.rate_of)
            settled = self._table[best]
            self._cruise_on(settled.mix, settled.latency)
            # Startup's phases are no cruise: its first began on an idle backend, whose first batch is quicker than
            # a steady one. Until a cruise phase has measured the usual, only a far slower backend gives way.
            self._provisional = True
        self._table, self._lost, self._last_step = {}, set(), None
        self._narrowing, self._narrowed, self._no_growth = False, 0, 0
        self.mode = "probe"
        self._ups = self._floor_phases = 0
        # Nothing tried below the limit settled on (a backend whose best is under ``START``): the cycle opens on
        # its probe down, after a cruise that drains what a higher limit left at the backend. Else it starts at a
        # random phase.
        if self._opening:
            self._index = 0
            return "cruise" if self.limit > self.cruise_limit else self._next_in_cycle()
        self._index = len(CYCLE) - 1 - self._rng.randrange(CYCLE_RAND)
        return self._next_in_cycle()

    def _again(self, rates: dict[int, float], best: int) -> int | None:
        """A limit below ``best`` to measure again before settling: one whose phase began on an idle gate, and
        which would win had it read ``IDLE_SHORTFALL`` low. Its first answers came in a burst: every client at
        once, their requests built by the clients and prepared by mmgate together, on cores the backend may share;
        on the real vLLM on two cores that phase read 17-37 % under the rate its limit keeps, and the climb's next
        step looked better for it."""
        worth = (1 - IDLE_SHORTFALL) * self._worth_settling(best, rates[best])
        return next((limit for limit, tried in self._table.items()
                     if tried.from_idle and limit < best and limit not in self._lost
                     and self._worth_settling(limit, rates[limit]) >= worth), None)

    def _next_in_cycle(self) -> Kind:
        self._index = (self._index + 1) % len(CYCLE)
        return CYCLE[self._index]

    def _after_probe(self, measured: Measured | None, spread: float) -> Kind:
        """The phase's verdict: ``measured``, and ``spread``, its rate's standard error as a share of it."""
        kind, limit = self.kind, self.cruise_limit
        if measured is None:
            return self._next_in_cycle()
        if isinstance(measured, AppLimited):
            mix, unfilled_latency = measured
            cruise = self.rate
            if (kind == "up" and limit < self._now.peak and cruise is not None
                    and self.rate_of(mix) >= (1 + GROW_MIN) * cruise):
                # more demand than the cruise limit, less than the probe's: the probe paid, up to what was used
                self.cruise_limit = min(self.limit, self._now.peak)
                self._why = "probe up paid, up to what demand used"
                self._cruise_on(mix, unfilled_latency)
            elif self._now.peak < limit:  # RFC 7661: a limit that demand left unused comes down to what it used
                if self._validated is None or self._validated[0] < limit:
                    self._validated = (limit, self._clock())
                self.cruise_limit = max(self.floor, self._now.peak)
                self._why = f"demand used only {self._now.peak}"
                # what was used, not what it could
                self.mix, self.latency, self._top = mix or None, unfilled_latency, None
            else:
                self._why = f"{kind}: demand did not fill the limit"
            self._ups = self._floor_phases = 0
            return self._next_in_cycle()
        mix, latency = measured
        rate, cruise = self.rate_of(mix), self.rate
        if kind == "up":
            if cruise is not None and rate * (1 - CONFIDENCE * spread) >= (1 + GROW_MIN) * cruise:
                self._why = f"probe up paid: the rate grew ×{rate / cruise:.2f}" if cruise else "probe up paid"
                in_proportion = rate >= cruise * (1 + PROPORTIONAL * (self.limit / limit - 1))
                self.cruise_limit = self.limit
                self._cruise_on(mix, latency)
                self._ups = self._ups + 1 if in_proportion else 0
                if self._ups >= 2:  # far below the knee (after a collapse, or demand grew): doubling again
                    self.mode, self._no_growth, self._last_step = "startup", 0, None
                    return self._after_startup(measured, spread)
                self._index = 0
                return "up"  # the climb goes on
            self._why = "probe up did not pay"
            self._ups = 0
        elif kind == "down":
            surely = rate * (1 - CONFIDENCE * spread)
            if cruise is not None and surely >= KEEP_DOWN * self._to_keep():
                self.cruise_limit, self.mix, self.latency = self.limit, mix, latency
                self._why = "probe down kept the rate"
                if self.cruise_limit > self.floor:
                    self._index = 0
                    return "down"  # the descent goes on, as the climb does
            else:
                self._why = "probe down lost rate"
            if self._opening:  # the cycle goes on from a random phase, so that replicas do not probe in step
                self._opening = False
                self._index = 1 + self._rng.randrange(CYCLE_RAND)
        elif self.latency is not None and latency > self._tolerance() * max(1.0, self.latency):
            # The backend slowed down under the same limit: give way. Slower than the last phases and than the
            # classes' long averages both, so that a burst of fast answers, which lowers the former, does not
            # make the honest latency after it look like a slowdown (Gradient2's comparison is the latter).
            self._why = f"cruise: latency {latency / max(1.0, self.latency):.2f}× the usual; giving way"
            return self._give_way(self.latency / latency)
        elif (not self._provisional and cruise is not None and rate < FELL * cruise
              and latency > GREW * max(1.0, self.latency or 0.0)):
            # The rate fell under the same limit, and its latency grew, if less than the tolerance: the backend
            # changed (its knee moved below the limit, its work got dearer). Search again from a share as much
            # lower. (A rate that fell at the usual latency is demand, or a flood of fast answers, ending.)
            self._why = f"cruise: the rate fell to {rate / cruise:.2f}× while latency grew; giving way"
            return self._give_way(rate / cruise)
        else:  # the rate is the last phase's (a backend that got faster must not be judged by an old one)
            self._why = "cruise"
            self._cruise_on(mix, latency if self.latency is None or self._provisional else self.latency + SMOOTHING * (
                latency - self.latency))
            self._provisional = False
        self._floor_phases = self._floor_phases + 1 if self.cruise_limit == self.floor else 0
        if self._floor_phases >= FLOOR_PHASES:
            self._floor_phases, self._index = 0, 0
            self._why = f"{FLOOR_PHASES} busy phases at the floor: probing up"
            return "up"
        return self._next_in_cycle()


def _forget(times: list[float], time: float) -> None:
    """Take one ``time`` out of ascending ``times``, if it is there."""
    at = bisect_left(times, time)
    if at < len(times) and times[at] == time:
        del times[at]


def weighted_median(pairs: list[tuple[float, float]]) -> float | None:
    """The median of the values of (value, weight) pairs, each counting as much as its weight (Envoy judges a
    window by its p50); None without any."""
    half = sum(weight for _value, weight in pairs) / 2
    for value, weight in sorted(pairs):
        half -= weight
        if half <= 0:
            return value
    return pairs[-1][0] if pairs else None
