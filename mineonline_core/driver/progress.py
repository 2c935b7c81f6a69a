"""The driver's live progress display and the summary table at the end of a run.

``Progress`` runs on the driver, fed from ``hub.latest()`` about once a second: a rich live panel on
a terminal, plain periodic log lines otherwise (CI logs stay readable).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any, Callable


def format_value(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    if value == int(value) and abs(value) < 1e12:
        return f"{int(value):,}"
    if abs(value) >= 1e4 or abs(value) < 1e-3:
        return f"{value:.3e}"
    return f"{value:.4g}"


def summary_table(
    metrics: dict[str, float], *, env_steps: int | None = None, title: str = "mineonline run summary"
) -> Any:
    """A rich table of the last value of each metric, grouped by namespace."""
    from rich.table import Table

    table = Table(title=title, show_lines=False)
    table.add_column("group", style="cyan")
    table.add_column("metric")
    table.add_column("last value", justify="right")
    if env_steps is not None:
        table.add_row("", "env_steps", format_value(float(env_steps)))
    previous = None
    for key in sorted(metrics):
        group, _, rest = key.partition("/")
        table.add_row(group if group != previous else "", rest or group, format_value(metrics[key]))
        previous = group
    return table


def print_summary(metrics: dict[str, float], *, env_steps: int | None = None, file: IO[str] | None = None) -> None:
    from rich.console import Console

    Console(file=file or sys.stdout, width=100).print(summary_table(metrics, env_steps=env_steps))


# (label, metric key) shown by Progress when present.
PROGRESS_FIELDS = (
    ("env steps/s (rollout)", "rollout/env_steps_per_s"),
    ("samples/s (train)", "trainer/samples_per_s"),
    ("return mean", "episode/return_mean"),
    ("staleness mean", "replay/staleness_mean"),
    ("policy loss", "trainer/policy_loss"),
    ("value loss", "trainer/value_loss"),
    ("entropy", "trainer/entropy"),
    ("kl ref", "trainer/kl_ref"),
)
ITERATION_KEY = "trainer/iteration"


def format_eta(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Live view of a run on the driver: iteration, env steps and rates, return, staleness, losses, ETA.

    ``update(hub.latest())`` about once a second. On a terminal this is a rich live panel; when
    ``file`` is not a TTY (or ``force_terminal=False``, ``--no-progress``) it prints one plain line per
    ``interval_s`` seconds (and on ``close``). ``clock`` is injectable so tests need no sleeps.

    The run ends at ``num_iterations`` or at ``max_env_steps``, whichever comes first, so the bar and
    the ETA follow the larger of the two fractions done, and the line names the budget that will end
    the run (``env_steps 48,000/1,000,000`` rather than ``iter 12/400`` for a run that ends at 245).
    """

    def __init__(
        self,
        num_iterations: int,
        *,
        enabled: bool = True,
        file: IO[str] | None = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        force_terminal: bool | None = None,
        max_env_steps: int | None = None,
        start_iteration: int = 0,
    ) -> None:
        self.num_iterations, self.max_env_steps = num_iterations, max_env_steps
        self.start_iteration = start_iteration  # a resumed run shows its checkpoint's iteration, not 0
        self.enabled = enabled
        self.file = file or sys.stdout
        self.interval_s = interval_s
        self.clock = clock
        self.tty = force_terminal if force_terminal is not None else bool(getattr(self.file, "isatty", lambda: False)())
        self._start = clock()
        self._first_iteration: tuple[float, float] | None = None  # (time, fraction done) at first sight
        self._last_print = -math.inf
        self._latest: dict[str, float] = {}
        self._live: Any = None
        if enabled and self.tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._render(), console=Console(file=self.file), refresh_per_second=2, transient=False)
            self._live.start()

    def iteration(self) -> int:
        return int(self._latest.get(ITERATION_KEY) or self.start_iteration)

    def _by_steps(self) -> bool:
        """Whether the env-step budget is ahead of the iteration budget (so it will end the run)."""
        if not self.max_env_steps:
            return False
        steps = float(self._latest.get("env_steps", 0.0)) / self.max_env_steps
        return self.num_iterations <= 0 or steps > self.iteration() / self.num_iterations

    def done_fraction(self) -> float:
        """How much of the run is done, by the budget that ends it first (0 without a budget)."""
        if self._by_steps():
            assert self.max_env_steps
            return min(float(self._latest.get("env_steps", 0.0)) / self.max_env_steps, 1.0)
        return min(self.iteration() / self.num_iterations, 1.0) if self.num_iterations > 0 else 0.0

    def eta_s(self) -> float | None:
        """Seconds left, from the rate of progress since the first iteration this display saw."""
        done = self.done_fraction()
        if done >= 1.0:
            return 0.0
        if self._first_iteration is None:
            return None
        t0, done0 = self._first_iteration
        if done <= done0:
            return None
        return (self.clock() - t0) / (done - done0) * (1.0 - done)

    def _budget(self) -> str:
        steps = format_value(self._latest.get("env_steps", 0.0))
        if self._by_steps():
            return f"iter {self.iteration()} | env_steps {steps}/{format_value(float(self.max_env_steps or 0))}"
        return f"iter {self.iteration()}/{self.num_iterations} | env_steps {steps}"

    def update(self, latest: dict[str, float]) -> None:
        if not self.enabled:
            return
        self._latest = dict(latest)
        if self._first_iteration is None and ITERATION_KEY in latest:
            self._first_iteration = (self.clock(), self.done_fraction())
        if self._live is not None:
            self._live.update(self._render())
            return
        now = self.clock()
        if now - self._last_print >= self.interval_s:
            self._last_print = now
            print(self.line(), file=self.file, flush=True)

    def line(self) -> str:
        """The plain one-line rendering (non-TTY output)."""
        parts = [self._budget()]
        for label, key in PROGRESS_FIELDS:
            if key in self._latest:
                parts.append(f"{label} {format_value(self._latest[key])}")
        if self._latest.get("logger/errors"):
            parts.append(f"logger errors {int(self._latest['logger/errors'])}")
        parts.append(f"elapsed {format_eta(self.clock() - self._start)}")
        parts.append(f"ETA {format_eta(self.eta_s())}")
        return " | ".join(parts)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        head = Table.grid(padding=(0, 2))
        head.add_row(
            f"[bold]{self._budget()}[/]",
            ProgressBar(total=1000, completed=round(1000 * self.done_fraction()), width=40),
            f"ETA {format_eta(self.eta_s())}",
            f"elapsed {format_eta(self.clock() - self._start)}",
        )
        body = Table.grid(padding=(0, 3))
        cells = [(label, format_value(self._latest[key])) for label, key in PROGRESS_FIELDS if key in self._latest]
        if self._latest.get("logger/errors"):
            cells.append(("[red]logger errors[/]", str(int(self._latest["logger/errors"]))))
        for i in range(0, len(cells), 3):
            row = cells[i : i + 3]
            body.add_row(*[f"[dim]{label}[/] {value}" for label, value in row])
        return Group(head, body)

    def close(self) -> None:
        """Stop the live display (or print a final line)."""
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._render())
            self._live.stop()
            self._live = None
        else:
            print(self.line(), file=self.file, flush=True)
        self.enabled = False
