"""How many torch CPU threads the engine's decode steps run on: the most, unless fewer measure
faster now.

    threads = StepThreads(most=torch.get_num_threads())
    count = threads.before()              # the count this step runs on (torch.set_num_threads)
    ...                                   # the step
    threads.after(rows, seconds, context) # its rows, what it took, its longest row's positions

A step is hundreds of parallel regions, and each waits at its end for every thread of torch's team.
When another process takes a core, the scheduler parks one of those threads for a slice of the
other's time, region after region, and a step runs many times slower (docs/design.md, "The step
threads beside other work"); fewer threads then run faster. Each band of row counts (1, 2-3, 4-7,
...) chooses on its own: a step of a row or two is bound by memory, about as fast on one thread
as on two, while sixteen rows are bound by the multiplies, which two threads share. So now and
then a probe runs PROBE_STEPS steps on a neighbouring count (one fewer, or one more up to `most`);
its first step is not judged (threads that slept get the core first for a while), the others are
compared with the median of the current count's latest steps of as many rows. A probe that takes
under half that time switches the count at once. Otherwise beside a busy core single steps vary
by 2x either way, and which count is faster changes with phases of seconds (a served run of 16
streams beside one `yes` switched 11 times a minute when one winning step switched): a count
switches when the running mean of its probes is clearly lower after two probes or more, the
count left behind counts as having lost, and for a while after a switch (longer each time the
band switches soon again) only a decisive probe switches it. A probe that loses waits twice as
long before the next one, so on a quiet machine (or a busy one) the probes cost almost nothing
once the count has settled; and when a slow mean of the current count's steps gets clearly slower
or faster than at the last probe (another process started or ended), a probe runs a few steps
later. A band on fewer threads than the most also probes one more when the machine shows an idle
core (`idle`: /proc/stat): a busy process that ended leaves the steps on fewer threads as fast as
they were beside it, with nothing else to call a probe. The other way, other processes' CPU time
(`others`: /proc/stat's busy time less this process's) tells a core taken without a losing probe:
the first step starts on as many threads as the cores the others leave (a served start beside a
busy core ran its first 40 steps on two threads before its probes moved it), and a band on more
threads than that calls a probe of one fewer at once, with a back-off of its own. The engine looks
while it waits for requests too, so the first step after a quiet spell reads the last second,
not the spell. The count never changes a row's numbers: the compact forward's kernels give the
same bits on any count (tests/test_streaming_backend/test_engine/test_engine_invariance.py).

The slowdown is the recent steps' time against the fastest step since load of the same rows
at a like context (the longest row's positions, within a factor of sqrt(2): attention over 512
positions made a default-model step 1.3x as long as over 20, so a long answer read as starved
when its steps were compared with its first), so an operator sees a starved server (`/status`,
tokenstream_step_slowdown) before users complain.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

SWITCH_MARGIN = 0.8  # a probe wins when it takes less than this share of the current count's time
DECISIVE = 0.5  # a probe this much faster switches at once; else the mean of its probes decides
PROBE_SMOOTHING = 0.5  # weight of the newest probe in a count's running mean of probes
PROBE_STEPS = 3  # steps of a probe: the first warms up, the others are judged
LATEST_STEPS = 8  # a probe's steps are compared with the median of this many of the current's
CHANGE_STEPS = 3  # steps on the current count between a change seen and its probe
# a band's count holds this long after a switch unless a probe is decisive: beside a busy core
# the faster count changed with phases of seconds, and followed them; twice as long after each
# switch that comes within four holds of the last, up to the longest
HOLD_S = 30.0
LONGEST_HOLD_S = 480.0
FIRST_PROBE_STEPS = 16  # decode steps between probes after a switch (or at load)
# the longest wait between probes, after repeated losses: a count chosen in a busy spell that
# the spell's end does not make clearly faster (one thread, when the other process stops) is
# kept at most this many steps; on an idle machine PROBE_STEPS in this many run on another count
LAST_PROBE_STEPS = 256
SMOOTHING = 0.2  # weight of the newest step in the report's running mean of like steps
TREND_SMOOTHING = 0.05  # the same for the slower mean that tells the machine changed
CHANGE = 1.3  # a trend this many times slower or faster than at the last probe: probe now
SWITCH_WINDOW_S = 60.0  # StepReport.switches_last_minute counts the switches this recent
# A band on fewer threads than the most calls a probe of one more as soon as the machine had at
# least this many cores idle over about its last IDLE_CHECK_STEPS steps (a busy process ended: the
# steps on fewer threads are no faster for it, and nothing else would call a probe before the
# band's wait ran out, up to LAST_PROBE_STEPS); such probes that lose wait twice as long each time
IDLE_CORES = 0.5
IDLE_CHECK_STEPS = 8
# Other processes' CPU time over a look, in cores: a count of threads is more than the machine
# leaves when the others take at least OTHER_CORES of the cores it needs (on 2 cores, two threads
# beside others using half a core or more). The first step starts on the most that are not; a
# band on more calls a probe of one fewer, such probes that lose waiting twice as long each time
OTHER_CORES = 0.5
MIN_LOOK_S = 0.25  # a look over less time than this keeps the last one's reading (10 ms ticks)
LOOK_S = 1.0  # how often the engine looks while it waits for requests (waiting())
START_LOOKS = 3  # the first step starts on fewer threads when this many looks before it agree


def usable_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on (a container's cpuset, taskset), or None where the
    system does not say."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _stat_fields(path: str, cpus: frozenset[int] | None = None) -> list[int] | None:
    """The numbers of /proc/stat's first line (every CPU summed), or with `cpus` the sum of
    those CPUs' lines; None where unreadable (or none of them is listed)."""
    try:
        with open(path, encoding="ascii") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
            if cpus is None:
                return fields
            summed = None
            for line in stat:
                name, _, values = line.partition(" ")
                if not name.startswith("cpu"):
                    break
                if int(name[3:]) in cpus:
                    row = [int(v) for v in values.split()]
                    summed = row if summed is None else [a + b for a, b in zip(summed, row)]
            return summed
    except (OSError, ValueError):
        return None


def machine_idle_seconds(
    path: str = "/proc/stat", cpus: frozenset[int] | None = None
) -> float | None:
    """The machine's idle CPU time since boot, in seconds summed over its CPUs (the idle and
    iowait columns of /proc/stat's first line), or over `cpus` only; None where unreadable."""
    fields = _stat_fields(path, cpus)
    if fields is None or len(fields) < 5:
        return None
    return (fields[3] + fields[4]) / os.sysconf("SC_CLK_TCK")


def other_processes_seconds(
    stat: str = "/proc/stat", own: str = "/proc/self/stat", cpus: frozenset[int] | None = None
) -> float | None:
    """The CPU time since boot of every process but this one, in seconds summed over the CPUs
    (or `cpus`, this process's: other tenants' CPUs do not count): the busy time (user, nice,
    system, irq, softirq and steal: a hypervisor's other guests count as others) less this
    process's user and system time; None where unreadable."""
    fields = _stat_fields(stat, cpus)
    try:
        with open(own, encoding="ascii") as mine:
            after_name = mine.read().rsplit(")", 1)[1].split()  # the name may hold spaces
        used = int(after_name[11]) + int(after_name[12])  # utime, stime: fields 14 and 15
    except (OSError, ValueError, IndexError):
        return None
    if fields is None or len(fields) < 8:
        return None
    busy = fields[0] + fields[1] + fields[2] + sum(fields[5:8])
    return (busy - used) / os.sysconf("SC_CLK_TCK")


def count_beside(others: float, cores: int, most: int) -> int:
    """The most threads (1 .. most) whose cores other processes using `others` cores leave:
    a count c is too many when the others take OTHER_CORES or more of the c cores it needs."""
    fits = math.ceil(cores - others + OTHER_CORES) - 1  # the largest c < cores - others + margin
    return max(1, min(most, fits))


def context_band(positions: int) -> int:
    """Which band of like contexts `positions` falls in: bands are a factor sqrt(2) wide
    ([1, 1.41), [1.41, 2), [2, 2.83), ...: band 1, 2, 3, ...; 0 positions is band 0)."""
    return 0 if positions < 1 else int(2 * math.log2(positions)) + 1


@dataclass(frozen=True)
class StepReport:
    """What /status shows of the decode steps' threads and pace."""

    threads: int  # the count decode steps run on now
    most: int  # the count at load (torch's threads), never exceeded
    switches: int  # times the count changed since load
    recent_step_s: float | None  # running mean of steps like the latest, on the current count
    best_step_s: float | None  # the fastest of that row count at a like context, any count
    slowdown: float | None  # recent / best: 1.0 at full speed; None before a step of that count
    switches_last_minute: int = 0  # switches in the last SWITCH_WINDOW_S: a count that hunts

    def as_dict(self) -> dict:
        """The report by name (JSON)."""
        return dict(self.__dict__)


def _smoothed(mean: float | None, seconds: float, weight: float = SMOOTHING) -> float:
    """A running mean after one more step of `seconds` (the step itself when there was none)."""
    return seconds if mean is None else mean + weight * (seconds - mean)


def _longer(wait: int, won: bool) -> int:
    """The wait before the next probe after one that lost (twice as long, up to
    LAST_PROBE_STEPS) or won (back to FIRST_PROBE_STEPS)."""
    return FIRST_PROBE_STEPS if won else min(2 * wait, LAST_PROBE_STEPS)


def rows_band(rows: int) -> int:
    """Which band of row counts `rows` falls in, each its own choice of count: bands are a
    factor of two wide (1, 2-3, 4-7, 8-15, 16-31, ...: bands 1, 2, 3, ...; 0 rows is band 0)."""
    return max(rows, 0).bit_length()


@dataclass
class _Choice:
    """The count of one band of row counts, and what its steps measured."""

    current: int
    wait: int = FIRST_PROBE_STEPS  # steps between probes now
    until_probe: int = FIRST_PROBE_STEPS
    down_next: bool = True  # which neighbour the next probe tries
    probing: int | None = None  # the count of the probe under way
    left: int = 0  # that probe's steps still to run
    judged: list[float] = field(default_factory=list)  # its judged steps' time against current's
    # count -> (running mean of its probes' time against the current count's, probes taken)
    ratios: dict[int, tuple[float, int]] = field(default_factory=dict)
    switched_at: float | None = None  # clock() of the band's latest switch
    hold: float = HOLD_S  # how long after it only a decisive probe switches the band
    since_probe: int = 0  # its steps since its last probe
    idle_called: bool = False  # the probe under way (or next) was called by an idle core
    idle_wait: int = FIRST_PROBE_STEPS  # steps since the last probe before an idle core calls one
    busy_called: bool = False  # ... by other processes taking a core this count needs
    busy_wait: int = FIRST_PROBE_STEPS  # steps since the last probe before they call one
    # rows -> the latest steps' seconds at `current` (their median is what a probe must beat:
    # a running mean jumped with one slow step beside a busy core, and a probe then won by 3x)
    latest: dict[int, deque] = field(default_factory=dict)
    trend: dict[int, float] = field(default_factory=dict)  # rows -> slow mean at `current`
    settled: dict[int, float] = field(default_factory=dict)  # rows -> trend at the last probe


@dataclass
class StepThreads:
    """The thread count of the engine's decode steps (see the module docstring).

    Each band of row counts (rows_band) chooses its own count: a step of one or two rows reads
    its weights at memory speed on one thread about as fast as on two, so a probe of one thread
    there won by a hair of noise, and the count it set held for 16 rows too, which two threads
    decode 1.4x as fast (a served run of 16 streams on a 2-core Zen 4 hunted between 385 and 445
    tok/s). A band seen for the first time starts on the count of the band last used, and a
    band's switch takes along the bands on its old count that never switched themselves, unless
    their own probes found the new count slower."""

    most: int
    current: int = 0  # the count of the latest step's band; 0: start at `most`
    switches: int = 0
    _bands: dict[int, _Choice] = field(default_factory=dict)
    _probe: int | None = None  # the count the step in progress probes, if it is a probe
    _probed_band: int = 0  # the band whose probe that is
    # (rows, context_band) -> fastest seconds, any count
    _best: dict[tuple[int, int], float] = field(default_factory=dict)
    # (count, rows, context_band) -> running mean of its steps, for the report: a mean over all
    # contexts read below the best at the latest one (slowdowns of 0.5 under load)
    _recent: dict[tuple[int, int, int], float] = field(default_factory=dict)
    _last_rows: int = 0
    _last_band: int = 0
    clock: Callable[[], float] = time.monotonic  # when switches happen (tests give their own)
    # the machine's idle CPU seconds so far (machine_idle_seconds; tests give their own), or
    # None: no probe is called by an idle core
    idle: Callable[[], float | None] | None = None
    # other processes' CPU seconds so far (other_processes_seconds; tests give their own), or
    # None: the first step starts on `most` and no probe is called by a core taken
    others: Callable[[], float | None] | None = None
    cores: int = 0  # the CPUs `idle` and `others` sum over; 0: os.cpu_count()
    _look_mark: tuple | None = None  # (clock(), idle(), others()) at the last reading
    _until_look: int = IDLE_CHECK_STEPS
    _idle_now: bool = False  # the last reading saw IDLE_CORES idle
    _others_now: float | None = None  # the cores other processes used at the last reading
    # the latest readings taken while the engine waited (waiting()): the first step starts
    # beside a core taken only when every one of them saw it (a client that just started
    # shows in one or two)
    _waited: deque = field(default_factory=lambda: deque(maxlen=START_LOOKS))
    started: bool = False  # the start count is chosen (start())
    _started_below: float | None = None  # clock() when start() chose fewer than the most
    _switched_at: deque = field(default_factory=deque)  # clock() of the switches in the window
    _reading_failed: bool = False  # a reading raised (logged once)

    def __post_init__(self) -> None:
        if self.most < 1:
            raise ValueError(f"most must be at least 1, not {self.most}")
        self.current = self.current or self.most
        self.cores = self.cores or os.cpu_count() or self.most
        self._read()  # the mark the first reading counts from

    def waiting(self) -> None:
        """The engine waits for requests (called about every LOOK_S meanwhile): read the
        machine, so that the first step after the wait knows the last seconds, not the wait."""
        if self._read():
            self._waited.append(self._others_now)

    def before(self) -> int:
        """The count the next step runs on, its band's (the band of the last step's rows): now
        and then a neighbour (a probe), once that count has a time for as many rows as the last
        step had, to compare with. The first step starts on the threads that the cores other
        processes left while the engine waited allow."""
        self._probe = None
        if not self.started:
            self.start()
        if self.most == 1 or self._last_rows == 0:
            return self.current
        choice = self._choice(self._last_rows)
        self.current = choice.current
        if self._last_rows not in choice.latest:
            return self.current
        choice.until_probe -= 1
        if choice.until_probe > 0:
            return self.current
        if choice.probing is None:  # a new probe; one called by an idle core tries one more,
            # one called by a core taken one fewer (where that count exists: else a neighbour)
            called = choice.current + (1 if choice.idle_called else -1)
            if (choice.idle_called or choice.busy_called) and 1 <= called <= self.most:
                probing = called
            else:
                probing = self._neighbour(choice)
            choice.probing, choice.left, choice.judged = probing, PROBE_STEPS, []
        self._probe, self._probed_band = choice.probing, rows_band(self._last_rows)
        return self._probe

    def after(self, rows: int, seconds: float, context: int = 0) -> None:
        """Record the time of the step `before` was asked for, whose longest row attended over
        `context` positions; switch its band's count if its probe won."""
        self._last_rows, self._last_band = rows, context_band(context)
        key = (rows, self._last_band)
        self._best[key] = min(seconds, self._best.get(key, seconds))
        probe, self._probe = self._probe, None
        choice = self._choice(rows)
        if probe is None:
            like = (self.current, *key)
            self._recent[like] = _smoothed(self._recent.get(like), seconds)
            self._until_look -= 1
            if self._until_look <= 0:  # once in IDLE_CHECK_STEPS steps
                self._until_look = IDLE_CHECK_STEPS
                self._read()
            if choice.current != self.current:  # ran on another band's count: not this one's time
                return
            choice.latest.setdefault(rows, deque(maxlen=LATEST_STEPS)).append(seconds)
            choice.trend[rows] = trend = _smoothed(choice.trend.get(rows), seconds, TREND_SMOOTHING)
            choice.since_probe += 1
            if choice.until_probe > 1:
                if (
                    choice.current < self.most
                    and choice.since_probe >= choice.idle_wait
                    and self._idle_now
                ):  # a busy process ended: the steps on fewer threads are no faster for it
                    choice.until_probe, choice.idle_called = 1, True
                elif (
                    self._others_now is not None
                    and choice.current > count_beside(self._others_now, self.cores, self.most)
                    and choice.since_probe >= choice.busy_wait
                ):  # another process took a core this count needs: is one fewer faster now?
                    choice.until_probe, choice.busy_called = 1, True
            settled = choice.settled.setdefault(rows, trend)
            changed = trend > CHANGE * settled or CHANGE * trend < settled
            if changed and choice.until_probe > CHANGE_STEPS:  # the machine changed: probe
                # against the steps since (a median of the steps before would hide the change)
                choice.latest[rows] = deque([seconds], maxlen=LATEST_STEPS)
                choice.wait, choice.until_probe = FIRST_PROBE_STEPS, CHANGE_STEPS
            return
        probed = self._bands[self._probed_band]
        probed.left -= 1
        # the first step runs on threads that slept, which the scheduler favours for a while
        # beside a busy core: not judged. A step of rows the current count has no time for (or
        # of another band) has nothing to compare with.
        if probed.left < PROBE_STEPS - 1 and probed is choice and rows in choice.latest:
            probed.judged.append(seconds / statistics.median(choice.latest[rows]))
        if probed.left > 0:
            probed.until_probe = 1
            return
        probed.probing = None
        if not probed.judged:  # nothing to compare with: probe again
            probed.until_probe = 1
            return
        choice = probed
        ratio = sum(choice.judged) / len(choice.judged)
        mean, probes = choice.ratios.get(probe, (ratio, 0))
        # the mean no slower than a loss by the margin: probes from a busier (or quieter) spell
        # would hold off a switch for long after the spell ended
        mean = min(_smoothed(mean, ratio, PROBE_SMOOTHING), 1 / SWITCH_MARGIN)
        probes += 1
        choice.ratios[probe] = (mean, probes)
        now = self.clock()
        held = choice.switched_at is not None and now - choice.switched_at < choice.hold
        if ratio < DECISIVE or (probes > 1 and mean < SWITCH_MARGIN and not held):
            log.info(
                "decode steps of %d rows now on %d torch threads: %.2f of the time on %d",
                rows, probe, mean, choice.current,
            )  # fmt: skip
            self.switches += 1
            self._switched_at.append(now)
            # a band that switches again soon after its last switch is in a tie that the busy
            # core's phases tip either way: it holds twice as long each time
            recent = choice.switched_at is not None and now - choice.switched_at < 4 * choice.hold
            choice.hold = min(2 * choice.hold, LONGEST_HOLD_S) if recent else HOLD_S
            # the bands on the same count that never switched go along (and hold as long), unless
            # their own probes found the new count slower: beside a busy core each band decided
            # alone, 5 switches in the first minute for one change of the machine
            left = choice.current
            for band in self._bands.values():
                if band is choice or (
                    band.current == left
                    and band.switched_at is None
                    and band.ratios.get(probe, (0.0, 0))[0] < 1.0
                ):
                    self._move(band, probe)
                    band.switched_at, band.hold = now, choice.hold
            self.current = probe
        elif ratio < SWITCH_MARGIN and not held:  # a win, not yet enough: probe again soon
            choice.wait = FIRST_PROBE_STEPS
        else:
            choice.wait = _longer(choice.wait, won=False)
        if rows in choice.trend:
            choice.settled[rows] = choice.trend[rows]
        # a probe an idle core (or a core taken) called that loses: the next such waits longer
        won = ratio < SWITCH_MARGIN
        if choice.idle_called:
            choice.idle_wait = _longer(choice.idle_wait, won)
        if choice.busy_called:
            choice.busy_wait = _longer(choice.busy_wait, won)
        choice.until_probe, choice.since_probe = choice.wait, 0
        choice.idle_called = choice.busy_called = False

    @staticmethod
    def _move(choice: _Choice, count: int) -> None:
        """Put a band on `count`, the count it leaves standing as a loss by the margin (so a
        tie does not switch back) and its steps' times forgotten (they were the old count's)."""
        choice.ratios = {choice.current: (1 / SWITCH_MARGIN, 2)}
        choice.current = count
        choice.latest, choice.trend, choice.settled = {}, {}, {}
        choice.wait = choice.until_probe = FIRST_PROBE_STEPS
        # a probe called (or under way) was of the old count's neighbour: a band on two threads
        # taken along to one kept its call for one fewer, and its next probe asked for none
        choice.probing, choice.idle_called, choice.busy_called = None, False, False

    def _read(self) -> bool:
        """Read the machine's idle and the other processes' CPU time; when at least MIN_LOOK_S
        passed since the last reading, update what they say over that time (else keep it).
        Whether the readings were updated."""
        if self.idle is None and self.others is None:
            return False
        now, mark = self.clock(), self._look_mark
        if mark is not None and now - mark[0] < MIN_LOOK_S:  # read /proc only when it counts
            return False
        idle, others = self._value(self.idle), self._value(self.others)
        self._look_mark = (now, idle, others)
        if mark is None:
            return False
        span = now - mark[0]
        self._idle_now = (
            idle is not None and mark[1] is not None and (idle - mark[1]) / span >= IDLE_CORES
        )
        self._others_now = (
            None if others is None or mark[2] is None else max(0.0, (others - mark[2]) / span)
        )
        return True

    def _value(self, reading: Callable[[], float | None] | None) -> float | None:
        """What `reading` returns, None where there is none or it raised (logged once): the
        readings only call probes, so a failed one must not fail the step that asked."""
        if reading is None:
            return None
        try:
            return reading()
        except Exception:  # noqa: BLE001 - logged once; the steps go on without that reading
            if not self._reading_failed:
                self._reading_failed = True
                log.exception("reading the machine for the step threads failed")
            return None

    def start(self) -> int:
        """The count the engine's first step (a prefill or a decode step) runs on: fewer than
        the most when every look of the wait before it saw other processes take a core that
        many need. Chosen once; later calls return the current count."""
        if self.started:
            return self.current
        self.started = True
        self._read()
        if len(self._waited) < START_LOOKS or any(o is None for o in self._waited):
            return self.current
        others = min(self._waited)
        start = count_beside(others, self.cores, self.most)
        if start != self.current:
            log.info(
                "decode steps start on %d torch threads: other processes used %.1f of %d cores",
                start, others, self.cores,
            )  # fmt: skip
            self.current, self._started_below = start, self.clock()
        return self.current

    def _choice(self, rows: int) -> _Choice:
        """The band of `rows`' choice; a new band starts on the latest count."""
        band = rows_band(rows)
        if band not in self._bands:
            choice = self._bands[band] = _Choice(self.current)
            start = self._started_below
            if start is not None and self.clock() - start < HOLD_S and self.current < self.most:
                # started below the most beside a core taken: as after a switch from one more
                # (it stands as a loss by the margin, and the band holds): started bands with
                # neither went up on a probe that won by noise, and the core taken called
                # them down again (4 switches a minute)
                choice.ratios = {self.current + 1: (1 / SWITCH_MARGIN, 2)}
                choice.switched_at = start
        return self._bands[band]

    def report(self) -> StepReport:
        """The count, and the recent and best step time of the latest step's rows and context."""
        recent = self._recent.get((self.current, self._last_rows, self._last_band))
        best = self._best.get((self._last_rows, self._last_band))
        slowdown = recent / best if recent is not None and best else None
        since = self.clock() - SWITCH_WINDOW_S
        while self._switched_at and self._switched_at[0] < since:
            self._switched_at.popleft()
        return StepReport(
            self.current, self.most, self.switches, recent, best, slowdown, len(self._switched_at)
        )

    def _neighbour(self, choice: _Choice) -> int:
        """One fewer or one more than the band's count (within 1 .. most), taking turns where
        both exist."""
        down, up = choice.current - 1, choice.current + 1
        if down < 1:
            return up
        if up > self.most:
            return down
        choice.down_next = not choice.down_next
        return up if choice.down_next else down
