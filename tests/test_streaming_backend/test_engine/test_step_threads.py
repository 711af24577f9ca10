"""The decode steps' thread count, chosen by measurement (engine/step_threads.py)."""

from __future__ import annotations

import random

import pytest

from streaming_backend.engine.step_threads import (
    FIRST_PROBE_STEPS,
    HOLD_S,
    IDLE_CHECK_STEPS,
    LAST_PROBE_STEPS,
    LONGEST_HOLD_S,
    LOOK_S,
    PROBE_STEPS,
    START_LOOKS,
    SWITCH_WINDOW_S,
    StepReport,
    StepThreads,
    context_band,
    count_beside,
    machine_idle_seconds,
    other_processes_seconds,
    rows_band,
)

# seconds per step on 1 and 2 threads: an idle 2-core machine, and one with a core taken
IDLE = {1: 0.016, 2: 0.010}
CORE_TAKEN = {1: 0.020, 2: 0.400}


class Clock:
    """A clock that the steps of `run` move on by their own time."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def stepping(most: int = 2, current: int = 0) -> StepThreads:
    """Step threads on a Clock."""
    return StepThreads(most=most, current=current, clock=Clock())


def run(threads: StepThreads, seconds: dict[int, float], steps: int, rows: int = 1) -> list[int]:
    """`steps` decode steps whose time depends on the count they run on; the counts used."""
    used = []
    for _ in range(steps):
        count = threads.before()
        used.append(count)
        threads.after(rows, seconds[count])
        if isinstance(threads.clock, Clock):
            threads.clock.now += seconds[count]
    return used


def test_on_an_idle_machine_the_count_stays_and_probes_thin_out():
    """Probes of one thread lose; each loss doubles the wait before the next, up to a limit,
    so after a while PROBE_STEPS steps in LAST_PROBE_STEPS run on the other count (a probe's
    first step warms the threads up, the others are judged)."""
    threads = stepping()
    used = run(threads, IDLE, 20_000)
    assert threads.current == 2 and threads.switches == 0
    probed = [i for i, count in enumerate(used) if count == 1]
    starts = [i for i in probed if i - 1 not in probed]
    assert probed == sorted(i + k for i in starts for k in range(PROBE_STEPS))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] == 2 * FIRST_PROBE_STEPS + PROBE_STEPS - 1
    assert gaps[-1] == LAST_PROBE_STEPS + PROBE_STEPS - 1
    assert gaps == sorted(gaps)
    assert len(starts) < 20_000 / LAST_PROBE_STEPS + 5  # the thinned-out rate, and the first few


def test_a_taken_core_moves_the_steps_to_one_thread_and_back_when_it_is_free():
    """With a core taken, the first probe (one thread) wins and the count drops; probes of two
    threads then lose until the core is free again, when one wins and the count goes back (not
    before HOLD_S after the first switch: the win by 0.625x is not decisive)."""
    threads = stepping()
    run(threads, IDLE, 100)
    used = run(threads, CORE_TAKEN, FIRST_PROBE_STEPS * 3)
    assert threads.current == 1 and threads.switches == 1
    assert used.count(2) <= FIRST_PROBE_STEPS + 1  # the steps before the first probe
    used = run(threads, CORE_TAKEN, 500)
    assert threads.current == 1 and 0 < used.count(2) < 5 * PROBE_STEPS  # probes, thinning out
    run(threads, IDLE, 4000)  # HOLD_S after the switch, then the next probe
    assert threads.current == 2 and threads.switches == 2


def test_a_core_taken_after_the_probes_thinned_out_is_noticed_at_once():
    """After long quiet the probes are LAST_PROBE_STEPS apart, but once the current count's
    steps get clearly slower, the next step probes and the count drops within a few steps; when
    the core is free again the one-thread steps get faster, which calls a probe (the trend that
    tells the machine changed is a slow mean), and the count climbs back within three probes
    (the mean of two threads' probes, made in the busy spell, counts as a loss by the margin).
    """
    threads = stepping()
    run(threads, IDLE, 20_000)
    used = run(threads, CORE_TAKEN, 10)
    assert threads.current == 1 and used.count(2) <= 3
    run(threads, CORE_TAKEN, 20_000)
    freed = {1: 0.014, 2: 0.010}  # one thread gets faster too when the other core is free
    run(threads, freed, 100)
    assert threads.current == 2


def test_each_band_of_rows_chooses_its_own_count():
    """Two rows read their weights at memory speed, as fast on one thread as on two (here
    faster); sixteen rows decode 1.5x as fast on two. A load that moves between them keeps two
    threads for sixteen rows while two rows settle on one, and the report names the count of
    the latest step's band."""
    times = {2: {1: 0.006, 2: 0.008}, 16: {1: 0.039, 2: 0.026}}
    threads = stepping()
    used = {2: [], 16: []}
    for spell in range(40):
        rows = 2 if spell % 2 == 0 else 16
        for _ in range(50):
            count = threads.before()
            used[rows].append(count)
            threads.after(rows, times[rows][count])
        assert threads.report().threads == (1 if rows == 2 else 2)
    assert used[2][-50:].count(1) > 45  # one thread, a probe of two now and then
    assert used[16][-50:].count(2) > 45
    # two rows down to one thread; sixteen, first seen on the latest count (one), back up to two
    assert threads.switches == 2


def test_row_bands_are_a_factor_of_two_wide():
    """Rows 1, 2-3, 4-7, 8-15, 16-31 are bands 1 to 5; none is band 0."""
    assert [rows_band(n) for n in (0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32)] == [
        0, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6
    ]  # fmt: skip


def test_one_thread_means_no_probes():
    """With one thread there is nothing to try."""
    threads = StepThreads(most=1)
    assert run(threads, {1: 0.01}, 100) == [1] * 100


def test_counts_climb_one_at_a_time_within_one_and_the_most():
    """On more cores the probes try one fewer and one more in turn, never past `most` or
    below one: four cores, where three run fastest, settle on three."""
    times = {1: 0.04, 2: 0.03, 3: 0.01, 4: 0.05}
    threads = stepping(most=4)
    used = run(threads, times, 3000)
    assert threads.current == 3 and set(used) <= {1, 2, 3, 4}


def test_a_probe_with_other_rows_than_its_comparison_decides_nothing():
    """A probe step whose rows differ from the last step's has no time to compare with: the
    count stays, and the probe comes again as soon as the current count has timed such a step."""
    threads = stepping()
    for _ in range(2 * FIRST_PROBE_STEPS):  # steps of 4 rows until the first probe
        if threads.before() == 1:
            break
        threads.after(4, IDLE[2])
    else:
        pytest.fail("no probe")
    threads.after(5, 0.001)  # a step of 5 rows, much faster than 4 rows' time: not comparable
    assert threads.current == 2
    assert threads.before() == 2  # 5 rows have no time on two threads yet: one step measures it
    threads.after(5, 0.012)
    assert threads.before() == 1  # the probe again
    threads.after(5, 0.5)
    assert threads.current == 2


def test_the_report_gives_the_recent_step_time_against_the_best():
    """slowdown = the running mean of the latest row count's steps over its fastest step."""
    threads = stepping()
    assert threads.report() == StepReport(2, 2, 0, None, None, None)
    run(threads, IDLE, 10)
    assert threads.report().slowdown == pytest.approx(1.0)
    run(threads, {1: 0.08, 2: 0.05}, 60)  # five times slower now, and one thread is no help
    report = threads.report()
    assert report.best_step_s == pytest.approx(0.01)
    assert report.slowdown == pytest.approx(5.0, rel=1e-3)
    assert report.as_dict()["threads"] == 2


def test_most_must_be_positive():
    """A thread count below one is refused."""
    with pytest.raises(ValueError, match="at least 1"):
        StepThreads(most=0)


def test_the_slowdown_compares_steps_at_a_like_context():
    """A long answer's steps grow with its context; each is compared with the fastest step of
    a context within a factor of sqrt(2), so an idle server reads near 1.0 at any length, and a
    starved one still reads its slowdown."""
    threads = stepping()
    readings = []
    for context in range(20, 2000):
        count = threads.before()
        # attention: a default-model step 1.3x as long at 512 positions as at the start
        threads.after(1, IDLE[count] * (1 + 0.3 * context / 512), context)
        readings.append(threads.report().slowdown)
    assert max(readings[100:]) < 1.25
    assert threads.report().best_step_s > IDLE[2] * 1.5  # not the short context's best
    for _ in range(40):
        threads.after(1, 4 * IDLE[2] * (1 + 0.3 * 2000 / 512), 2000)
    assert threads.report().slowdown > 3.0


def test_a_longer_context_never_reads_faster_than_its_best():
    """The recent time is the running mean of steps like the latest (rows and context band), so
    a step at a new, longer context reads 1.0, not the short context's faster mean over its
    best (an engine test read 0.48 under load)."""
    threads = stepping()
    for _ in range(20):
        threads.after(1, 0.001, 4)
    threads.after(1, 0.002, 100)
    assert threads.report().slowdown == pytest.approx(1.0)
    threads.after(1, 0.004, 100)
    assert threads.report().slowdown == pytest.approx(1.2)  # (2 + 0.2 * (4 - 2)) / 2


def test_context_bands_are_a_factor_of_root_two_wide():
    """Positions [1, 1.41), [1.41, 2), [2, 2.83), ... are bands 1, 2, 3, ...; none is band 0."""
    positions = (0, 1, 2, 3, 4, 5, 6, 362, 363, 511, 512, 724, 725)
    assert [context_band(n) for n in positions] == [0, 1, 3, 4, 5, 5, 6, 17, 18, 18, 19, 19, 20]


def test_the_report_counts_the_switches_of_the_last_minute():
    """switches_last_minute: the switches within SWITCH_WINDOW_S of the report, by the clock the
    count was given; older ones leave it, the total stays."""
    now = [0.0]
    threads = StepThreads(most=2, clock=lambda: now[0])
    run(threads, IDLE, 100)
    run(threads, CORE_TAKEN, FIRST_PROBE_STEPS * 3)  # one switch, to one thread
    assert threads.report().switches_last_minute == 1
    now[0] = SWITCH_WINDOW_S / 2
    run(threads, IDLE, 2 * LAST_PROBE_STEPS)  # and back
    report = threads.report()
    assert (report.switches, report.switches_last_minute) == (2, 2)
    now[0] = SWITCH_WINDOW_S + 1
    assert threads.report().switches_last_minute == 1
    now[0] = 2 * SWITCH_WINDOW_S
    assert (threads.report().switches, threads.report().switches_last_minute) == (2, 0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tie_in_the_noise_of_a_busy_core_switches_at_most_twice_a_minute(seed):
    """Beside a busy core, 12 to 16 rows took 30 to 70 ms on two threads and 38 to 58 ms on one,
    a step in ten half as long again (a served run on a 2-core Xeon): a tie within the noise.
    Probes still win now and then, but a switch needs two wins in a row, and a spell of slow
    steps does not set off probes, so the count changes at most twice a minute (issue target;
    before the confirming probe these steps switched 6 to 9 times a minute)."""
    rng = random.Random(seed)
    threads = stepping()
    elapsed, rows = 0.0, 16
    for _ in range(12_000):
        if rng.random() < 0.05:  # streams end and others start
            rows = rng.randint(12, 16)
        count = threads.before()
        seconds = rng.uniform(0.030, 0.070) if count == 2 else rng.uniform(0.038, 0.058)
        seconds *= rows / 16 * (1.5 if rng.random() < 0.1 else 1.0)
        elapsed += seconds
        threads.after(rows, seconds)
        threads.clock.now = elapsed
    assert threads.switches <= 2 * elapsed / 60


def probe_steps(threads: StepThreads, rows: int, current: float, probe: list[float]) -> int:
    """Steps on the current count (`current` seconds each) until a probe starts; the probe's
    PROBE_STEPS steps then take `probe`'s times in turn. The number of steps before the probe."""
    assert len(probe) == PROBE_STEPS
    steps = 0
    while threads.before() == threads.current:
        threads.after(rows, current)
        steps += 1
        assert steps < 10 * LAST_PROBE_STEPS, "no probe"
    threads.after(rows, probe[0])
    for seconds in probe[1:]:
        assert threads.before() != threads.current
        threads.after(rows, seconds)
    return steps


def test_a_close_win_switches_only_when_the_mean_of_the_probes_holds_it():
    """A probe that takes 0.7x the current time may be the noise of a busy core: nothing
    switches until the running mean of that count's probes (PROBE_SMOOTHING) is under the margin
    after two probes or more, the next one FIRST_PROBE_STEPS later. One that takes under half
    the time switches at once (test_a_taken_core_moves_...)."""
    threads = stepping()
    probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028])  # one thread, 0.7x
    assert threads.current == 2 and threads.switches == 0
    assert probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028]) == FIRST_PROBE_STEPS - 1
    assert threads.current == 1 and threads.switches == 1
    # a close win that the next probe does not repeat pulls the mean back above the margin
    threads = stepping()
    probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028])
    probe_steps(threads, 16, 0.040, [0.028, 0.045, 0.045])
    probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028])
    assert threads.current == 2 and threads.switches == 0
    probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028])
    assert threads.current == 1 and threads.switches == 1


def test_the_count_left_behind_needs_clear_wins_to_come_back():
    """After a switch the count left behind stands as a loss by the margin: two close wins of it
    in a row do not switch back, so a tie within the noise does not hunt."""
    threads = stepping()
    for _ in range(2):
        probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028])
    assert threads.current == 1
    probe_steps(threads, 16, 0.028, [0.028, 0.021, 0.021])  # two threads, 0.75x
    probe_steps(threads, 16, 0.028, [0.028, 0.021, 0.021])
    assert threads.current == 1 and threads.switches == 1


def test_a_probes_first_step_is_not_judged():
    """The first step of a probe of more threads runs on threads that slept, which the scheduler
    favours for a while beside a busy core: 5 ms against 9 when the count's steps take 15. Only
    the probe's later steps are compared."""
    threads = stepping(current=1)
    probe_steps(threads, 1, 0.009, [0.005, 0.015, 0.015])
    probe_steps(threads, 1, 0.009, [0.005, 0.015, 0.015])
    assert threads.current == 1 and threads.switches == 0
    probe_steps(threads, 1, 0.009, [0.015, 0.004, 0.004])  # later steps under half: at once
    assert threads.current == 2 and threads.switches == 1


def test_a_switched_count_holds_unless_a_probe_is_decisive():
    """For HOLD_S after a switch only a decisive probe (under half the time) switches the band
    again; clear wins by less wait for the hold to end."""
    threads = stepping()
    for _ in range(2):
        probe_steps(threads, 16, 0.040, [0.028, 0.028, 0.028])
    assert threads.current == 1
    for _ in range(6):
        probe_steps(threads, 16, 0.028, [0.028, 0.018, 0.018])  # two threads, 0.64x
    assert threads.current == 1 and threads.switches == 1
    threads.clock.now += HOLD_S
    probe_steps(threads, 16, 0.028, [0.028, 0.018, 0.018])
    assert threads.current == 2 and threads.switches == 2
    probe_steps(threads, 16, 0.018, [0.018, 0.008, 0.008])  # one thread under half: at once
    assert threads.current == 1 and threads.switches == 3


def test_a_band_that_keeps_switching_holds_longer_each_time():
    """Each switch within four holds of the band's last one doubles its hold (up to
    LONGEST_HOLD_S); a switch after a long quiet spell starts from HOLD_S again."""
    threads = stepping()
    times = {1: 0.028, 2: 0.040}  # a step on each count: one thread wins by 0.7x
    switched = []
    for _ in range(7):
        count = threads.current
        for _ in range(10_000):  # close wins of the other count, a second apart, until it switches
            if threads.current != count:
                break
            probe_steps(threads, 16, times[count], [times[3 - count]] * PROBE_STEPS)
            threads.clock.now += 1.0
        switched.append(threads.clock.now)
        times = {1: times[2], 2: times[1]}  # and then the other way round
    holds = [b - a for a, b in zip(switched, switched[1:])]
    for hold, expected in zip(holds, [HOLD_S * 2**i for i in range(4)] + [LONGEST_HOLD_S] * 2):
        assert expected <= hold <= expected + 2
    threads.clock.now += 4 * LONGEST_HOLD_S  # a long quiet spell
    count = threads.current
    for _ in range(3):
        probe_steps(threads, 16, times[count], [times[3 - count]] * PROBE_STEPS)
    assert threads.current != count
    assert threads._bands[rows_band(16)].hold == HOLD_S


class Machine:
    """A clock, the machine's idle CPU seconds and other processes' CPU seconds: each step takes
    its seconds, during which `idle_cores` cores sit idle and other processes use `other_cores`."""

    def __init__(self):
        self.now, self.idle_s, self.idle_cores = 0.0, 0.0, 0.0
        self.others_s, self.other_cores = 0.0, 0.0

    def threads(self) -> StepThreads:
        """A two-thread StepThreads on a two-core machine's clock, idle and others' time."""
        return StepThreads(
            most=2,
            cores=2,
            clock=lambda: self.now,
            idle=lambda: self.idle_s,
            others=lambda: self.others_s,
        )

    def pass_time(self, seconds: float) -> None:
        self.now += seconds
        self.idle_s += self.idle_cores * seconds
        self.others_s += self.other_cores * seconds

    def wait(self, threads: StepThreads, looks: int) -> None:
        """The engine waits for requests: `looks` of LOOK_S."""
        for _ in range(looks):
            self.pass_time(LOOK_S)
            threads.waiting()

    def step(
        self, threads: StepThreads, seconds: dict[int, float], steps: int, rows: int = 1
    ) -> list[int]:
        used = []
        for _ in range(steps):
            count = threads.before()
            used.append(count)
            self.pass_time(seconds[count])
            threads.after(rows, seconds[count])
        return used


def test_an_idle_core_brings_a_band_back_to_two_threads_within_a_few_probes():
    """On one thread after a busy spell, where one thread is as fast as it was (so no change in
    its steps calls a probe), the band probes two threads as soon as the machine shows a core
    idle, not after its probes' long wait, and is back on two after two probes; without that
    reading it waits."""
    after_busy = {1: CORE_TAKEN[1], 2: IDLE[2]}  # one thread no faster: no change to notice
    counts = {}
    for idle_cores in (0.0, 0.9):
        machine = Machine()
        threads = machine.threads()
        machine.step(threads, IDLE, 100)
        machine.step(threads, CORE_TAKEN, 2000)  # busy past the hold; probes of two thinned out
        while machine.step(threads, CORE_TAKEN, 1) != [2]:  # until a probe: the next is far
            pass
        machine.step(threads, CORE_TAKEN, PROBE_STEPS - 1)
        assert threads.current == 1
        machine.idle_cores = idle_cores
        machine.step(threads, after_busy, 2 * (FIRST_PROBE_STEPS + PROBE_STEPS + IDLE_CHECK_STEPS))
        counts[idle_cores] = threads.current
    assert counts == {0.0: 1, 0.9: 2}


def test_beside_an_idle_core_the_probes_it_calls_thin_out_as_they_lose():
    """Where one thread is faster even on an idle machine, an idle core calls probes of two
    threads; each loses, and the next such probe waits twice as long (up to LAST_PROBE_STEPS)."""
    machine = Machine()
    machine.idle_cores = 1.0
    one_faster = {1: 0.010, 2: 0.016}
    threads = machine.threads()
    machine.step(threads, IDLE, 100)
    machine.step(threads, {1: 0.010, 2: 0.4}, 100)  # a busy spell: down to one thread
    assert threads.current == 1
    used = machine.step(threads, one_faster, 5000)
    assert threads.current == 1
    probes = used.count(2) / PROBE_STEPS
    assert 0 < probes <= 5000 / LAST_PROBE_STEPS + 6  # 16, 32, ... 256 steps apart


def test_the_machines_idle_time_is_read_from_proc_stat(tmp_path):
    """Idle and iowait of /proc/stat's first line, in seconds; None where unreadable."""
    import os

    stat = tmp_path / "stat"
    stat.write_text("cpu  10 0 5 300 20 0 0 0 0 0\ncpu0 5 0 2 150 10 0 0 0 0 0\n")
    assert machine_idle_seconds(str(stat)) == pytest.approx(320 / os.sysconf("SC_CLK_TCK"))
    assert machine_idle_seconds(str(tmp_path / "absent")) is None
    assert machine_idle_seconds() is not None  # this machine's


def test_a_switch_takes_along_the_bands_that_have_not_decided_otherwise():
    """When a band switches, every band on the same count that never switched itself goes along
    (one switch) and holds as long, unless its own probes found the new count slower: beside a
    busy core each band deciding alone made 5 switches in the first minute for one change of the
    machine."""
    two_rows = {1: 0.006, 2: 0.010}  # one thread faster: the two-row band switches
    sixteen = {1: 0.039, 2: 0.026}  # two threads faster at sixteen rows
    for probed_sixteen, expected in ((False, 1), (True, 2)):
        threads = stepping()
        run(threads, sixteen, 40 if probed_sixteen else 5, rows=16)  # 40: one losing probe
        run(threads, two_rows, 100, rows=2)
        assert threads.switches == 1 and threads.report().threads == 1
        assert threads._bands[rows_band(16)].current == expected
        used = run(threads, sixteen, 1500, rows=16)  # past the hold: a band taken along holds
        assert used[-1] == 2  # as long, then goes back if faster on its old count


@pytest.mark.parametrize(
    "others, cores, most, count",
    [
        (0.0, 2, 2, 2),
        (0.49, 2, 2, 2),  # under half a core: both threads
        (0.5, 2, 2, 1),  # half a core of the two a count of two needs
        (1.0, 2, 2, 1),
        (2.0, 2, 2, 1),  # never below one
        (0.3, 16, 16, 16),
        (1.0, 16, 16, 15),
        (8.6, 16, 8, 7),  # 7.4 cores left for eight threads
        (4.0, 16, 8, 8),  # the others leave the eight cores the count needs
    ],
)
def test_the_count_beside_other_processes_leaves_them_their_cores(others, cores, most, count):
    assert count_beside(others, cores, most) == count


@pytest.mark.parametrize(
    "other_cores, seen_by, start",
    [
        (0.0, START_LOOKS, 2),
        (1.0, START_LOOKS, 1),  # a busy process all along the wait: one thread from the first
        (0.4, START_LOOKS, 2),
        (1.0, 2, 2),  # only the last looks saw it (a client starting): the most
    ],
)
def test_the_first_step_starts_on_the_threads_other_processes_leave(other_cores, seen_by, start):
    """The first step runs on the count that the cores other processes used while the engine
    waited leave, when every one of the last START_LOOKS looks saw it; not a switch."""
    machine = Machine()
    threads = machine.threads()
    machine.wait(threads, START_LOOKS - seen_by)
    machine.other_cores = other_cores
    machine.wait(threads, seen_by)
    assert machine.step(threads, IDLE, 1) == [start]
    assert threads.current == start and threads.switches == 0


def test_without_looks_before_it_the_first_step_starts_on_the_most():
    """A request that comes before START_LOOKS looks (an engine just started, every unit test)
    starts on the most threads, whatever the machine does."""
    machine = Machine()
    machine.other_cores = 2.0
    threads = machine.threads()
    machine.wait(threads, START_LOOKS - 1)
    assert machine.step(threads, CORE_TAKEN, 1) == [2]


def after_a_probe(machine: Machine, threads: StepThreads, seconds, rows: int = 1) -> None:
    """Steps until a probe has run (the next is then its band's wait away)."""
    band = threads._bands[rows_band(rows)]
    while machine.step(threads, seconds, 1, rows) == [band.current]:
        pass
    machine.step(threads, seconds, PROBE_STEPS - 1, rows)


def test_a_core_taken_calls_a_probe_of_one_fewer_at_once():
    """On two threads whose probes of one have thinned out, another process taking a core (that
    leaves the two-thread steps within the change detector's margin) calls a probe of one
    thread within a look, and two winning probes switch; without the reading, the band waits."""
    quiet = {1: 0.016, 2: 0.012}
    taken = {1: 0.009, 2: 0.0135}  # one thread 0.67 of the time: wins, not decisively
    counts = {}
    for reading in (False, True):
        machine = Machine()
        threads = machine.threads()
        if not reading:
            threads.others = None
        machine.step(threads, quiet, 3000)  # the probes of one lost: 256 steps apart now
        assert threads._bands[1].wait == LAST_PROBE_STEPS
        after_a_probe(machine, threads, quiet)
        machine.other_cores = 1.0
        machine.step(threads, taken, 100)
        counts[reading] = threads.current
    assert counts == {False: 2, True: 1}


def test_the_probes_a_taken_core_calls_thin_out_as_they_lose():
    """Where two threads stay faster beside the other process (sixteen rows), the probes of one
    it calls lose, and each such waits twice as long as the last, up to LAST_PROBE_STEPS."""
    machine = Machine()
    sixteen = {1: 0.039, 2: 0.026}
    threads = machine.threads()
    machine.other_cores = 1.0
    used = machine.step(threads, sixteen, 5000, rows=16)
    assert threads.current == 2 and threads.switches == 0
    probes = used.count(1) / PROBE_STEPS
    assert 0 < probes <= 5000 / LAST_PROBE_STEPS + 6
    assert threads._bands[rows_band(16)].busy_wait == LAST_PROBE_STEPS


def test_other_processes_time_is_the_busy_time_less_this_processs(tmp_path):
    """/proc/stat's user, nice, system, irq, softirq and steal, less this process's utime and
    stime (/proc/self/stat, whose name may hold spaces and parentheses); None where unreadable."""
    import os

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 5 40 300 20 3 2 10 0 0\ncpu0 50 0 2 150 10 0 0 0 0 0\n")
    own = tmp_path / "self"
    fields = ["S"] + ["0"] * 10 + ["30", "12"] + ["0"] * 30  # state, ..., utime, stime, ...
    own.write_text("4242 (a (b) c) " + " ".join(fields) + "\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert other_processes_seconds(str(stat), str(own)) == pytest.approx((160 - 42) / tick)
    assert other_processes_seconds(str(tmp_path / "absent"), str(own)) is None
    assert other_processes_seconds(str(stat), str(tmp_path / "absent")) is None
    assert other_processes_seconds() is not None  # this machine's


def test_a_start_beside_a_core_taken_holds_as_a_switch_does():
    """Bands that start on fewer threads beside a core taken hold that count as after a switch:
    probes of one more that win, but not decisively, switch only after the hold (and with the
    count above standing as a loss by the margin, after clear wins); a start on the most has
    no such hold."""
    two_faster = {1: 0.010, 2: 0.007}  # 0.7: a win, not a decisive one
    for taken, start in ((1.0, 1), (0.0, 2)):
        machine = Machine()
        threads = machine.threads()
        machine.other_cores = taken
        machine.wait(threads, START_LOOKS)
        machine.other_cores = 0.0
        used = machine.step(threads, two_faster, 400)  # about 3 s
        assert used[0] == start and threads.current == start and threads.switches == 0
        while machine.now < HOLD_S + 5:
            machine.step(threads, two_faster, 1)
        assert threads.current == 2 and threads.switches == (1 if start == 1 else 0)


def test_the_readings_can_sum_over_this_processs_cpus_only(tmp_path):
    """With `cpus` (a container's cpuset) idle and busy time are those CPUs' lines summed, not
    the whole machine's: other tenants' CPUs do not count."""
    import os

    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  300 0 30 700 0 0 0 0 0 0\n"
        "cpu0 100 0 10 100 0 0 0 0 0 0\n"
        "cpu1 10 0 0 290 0 0 0 0 0 0\n"
        "cpu2 190 0 20 310 0 0 0 0 0 0\n"
        "intr 5 0 0\n"
    )
    own = tmp_path / "self"
    own.write_text("7 (x) S " + " ".join(["0"] * 10 + ["20", "5"] + ["0"] * 30) + "\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert machine_idle_seconds(str(stat)) == pytest.approx(700 / tick)
    assert machine_idle_seconds(str(stat), frozenset({1, 2})) == pytest.approx(600 / tick)
    mine = other_processes_seconds(str(stat), str(own), frozenset({0, 1}))
    assert mine == pytest.approx((120 - 25) / tick)
    assert machine_idle_seconds(str(stat), frozenset({7})) is None  # no such CPU listed


def test_a_band_taken_along_while_its_probe_was_called_probes_within_one_and_the_most():
    """A core taken calls the sixteen-row band's probe of one fewer (two threads to one); before
    that probe runs, the two-row band switches to one thread and takes the sixteen-row band
    along. Its called probe must then try a count within 1 .. most, not one fewer than one (a
    served run's steps failed on torch.set_num_threads(0), three in a row, and the engine
    stopped)."""
    two_rows = {1: 0.004, 2: 0.010}  # one thread decisively faster at two rows
    sixteen = {1: 0.024, 2: 0.026}  # one thread a little faster: its probe loses by the margin
    machine = Machine()
    threads = machine.threads()
    used = machine.step(threads, sixteen, 20, rows=16)  # one probe of one thread, lost
    machine.other_cores = 1.0
    band = threads._bands[rows_band(16)]
    while not band.busy_called:
        used += machine.step(threads, sixteen, 1, rows=16)
        assert len(used) < 1000, "no probe called by the core taken"
    used += machine.step(threads, two_rows, 200, rows=2)
    assert threads._bands[rows_band(2)].current == 1 and band.current == 1
    used += machine.step(threads, sixteen, 200, rows=16)
    assert set(used) <= {1, 2}


@pytest.mark.parametrize("seed", range(40, 48))
def test_every_count_stays_within_one_and_the_most_whatever_the_machine_does(seed):
    """Streams of two and sixteen rows take turns, other processes and idle cores come and go,
    and which count is faster for each band changes with them (redrawn at each change): the
    bands switch, take each other along and have probes called by idle or taken cores, and
    every count a step is given lies within 1 .. most (seed 42 gave a step 0 threads)."""
    rng = random.Random(seed)
    machine = Machine()
    threads = machine.threads()
    rows, speed = 1, {}
    for _ in range(1000):
        if rng.random() < 0.3:
            rows = rng.choice([2, 16])
        if rng.random() < 0.005:
            machine.other_cores = rng.choice([0.0, 0.3, 1.0, 1.5])
            machine.idle_cores = rng.choice([0.0, 0.6, 1.0])
            speed = {}
        count = threads.before()
        assert 1 <= count <= threads.most, (count, threads.current, rows)
        key = (rows_band(rows), count)
        if key not in speed:
            speed[key] = rng.uniform(0.3, 1.5)
        seconds = rows * 0.002 * speed[key] * rng.uniform(0.9, 1.1)
        machine.pass_time(seconds)
        threads.after(rows, seconds, context=rng.randint(1, 600))
