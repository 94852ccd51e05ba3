"""Time caps of a training run whose first step compiles.

On the GPU machine the first optimizer step of a run is mostly compilation (inductor, Triton
autotuning): 106-119 s on the H200 against under a second for the steps after it. A time cap that
counted it would leave a run of a few minutes one step long, so :class:`TimeBudget` keeps two caps:

- ``minutes``: training time, counted from the end of the run's first step (data preparation, that
  step, the final evaluation and saving are not counted; periodic evaluations in between are);
- ``wall_minutes``: a hard cap on the whole invocation from ``launched`` (everything up to the end
  of the training loop), so that a stage still ends in time when compilation is slower than planned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable


class TimeBudget:
    def __init__(
        self,
        minutes: float | None,
        wall_minutes: float | None = None,
        launched: float | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.minutes, self.wall_minutes, self.clock = minutes, wall_minutes, clock
        self.launched = clock() if launched is None else launched
        self.started: float | None = None  # end of the run's first step: the training clock starts
        self.first_step_seconds: float | None = None
        self.steps = 0
        self.ended: float | None = None  # end of the training loop (:meth:`end`)

    def step_done(self, seconds: float) -> str | None:
        """Call after every step of the run (``seconds``: that step's time). After the first one it
        starts the training clock and returns the progress line that says so; else None."""
        self.steps += 1
        if self.steps > 1:
            return None
        self.started, self.first_step_seconds = self.clock(), seconds
        line = f"first step (compilation included) took {seconds:.0f} s"
        caps = []
        if self.minutes is not None:
            caps.append(f"training for {self.minutes:g} min from now")
        if self.wall_minutes is not None:
            caps.append(f"stopping at the latest {self.wall_minutes:g} min after launch ({self.wall_left() / 60:.1f} min from now)")
        return line + ("; " + ", ".join(caps) if caps else "")

    def wall_left(self) -> float:
        if self.wall_minutes is None:
            return math.inf
        return 60 * self.wall_minutes - (self.clock() - self.launched)

    def left(self) -> float:
        """Seconds until the earlier cap (inf without caps); before the first step has ended, the
        training time is whole."""
        training = math.inf
        if self.minutes is not None:
            training = 60 * self.minutes - (0.0 if self.started is None else self.clock() - self.started)
        return min(training, self.wall_left())

    def out_of_time(self) -> bool:
        """Whether to stop now: the wall cap at any step, the training cap from the second step on
        (the first step only starts its clock)."""
        if self.wall_left() <= 0:
            return True
        return self.minutes is not None and self.steps >= 2 and self.clock() - self.started >= 60 * self.minutes

    def reason(self) -> str:
        if self.wall_left() <= 0:
            return f"--max-wall-minutes {self.wall_minutes:g}"
        return f"--max-minutes {self.minutes:g} (after the first step)"

    def end(self) -> None:
        """The training loop is over (the report's training time stops here)."""
        self.ended = self.clock()

    def report(self) -> dict:
        """The caps, the first step's time and the training time after it, for a run's report."""
        ended = self.clock() if self.ended is None else self.ended
        return {
            "max_minutes": self.minutes,
            "max_wall_minutes": self.wall_minutes,
            "first_step_seconds": self.first_step_seconds,
            "seconds_after_first_step": None if self.started is None else ended - self.started,
        }
