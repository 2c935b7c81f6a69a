"""Episode statistics: moving-window returns and lengths, per task, and Crafter's achievements.

Rollout workers send one record per finished episode::

    {"return": float, "discounted_return": float, "length": int, "task": str | None,
     "achievements": dict[str, int] | None, "truncated": bool, "stream": str}

``EpisodeStatistics`` keeps the last ``window`` episodes (overall and per task) and pushes a summary
to the ``LoggerHub`` every ``report_every`` episodes. For Crafter it reports the success rate of each
of the 22 achievements over the window (an achievement succeeds in an episode when its count is
> 0) and the Crafter score of Hafner (2021), the geometric mean of the success rates in percent:
``exp(mean_i ln(1 + s_i)) - 1``, over the window (``crafter/score``: how the policy does now) and
over every episode since the start (``crafter/all_episodes/*``: the paper's rule, which takes the rates
over all training episodes up to the step budget; its table is comparable with the last value logged
at or before the budget). The all-episode counts start again at a resume.

The actor is restarted by Ray when its process dies (``ACTOR_OPTIONS``: same name, same handle, calls
in flight retried, at most ``MAX_ACTOR_RESTARTS`` times). The window dies with the process: the restarted
actor says so on the console and in ``run.log``, counts the restart in ``stats/restarts`` and fills a new
window from the episodes that finish after it; ``episode/count`` starts again from 0.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
from mineonline_core.builtin.envs import CRAFTER_ACHIEVEMENTS, crafter_score
from mineonline_core.services.names import EPISODE_STATISTICS
from mineonline_core.services.restarts import MAX_ACTOR_RESTARTS, actor_restart
from mineonline_core.services.runlog import setup_actor_logging

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from mineonline_core.services.loggerhub import LoggerHub

log = logging.getLogger(__name__)

#: ``ray.remote(EpisodeStatistics).options(**ACTOR_OPTIONS, ...)``: restarted in place when its process dies.
ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": MAX_ACTOR_RESTARTS, "max_task_retries": -1}
#: How many times Ray restarted the run's episode statistics actor (logged to the hub at each restart).
RESTARTS_METRIC = "stats/restarts"


def _metric_name(task: str) -> str:
    # Task names become one path segment of a metric key.
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in task) or "_"


def _window_stats(prefix: str, episodes: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    episodes = list(episodes)
    if not episodes:
        return {}
    returns = np.array([float(e["return"]) for e in episodes])
    return {
        f"{prefix}/return_mean": float(returns.mean()),
        f"{prefix}/return_std": float(returns.std()),
        f"{prefix}/return_min": float(returns.min()),
        f"{prefix}/return_max": float(returns.max()),
        f"{prefix}/discounted_return_mean": float(
            np.mean([float(e.get("discounted_return", math.nan)) for e in episodes])
        ),
        f"{prefix}/length_mean": float(np.mean([float(e["length"]) for e in episodes])),
        f"{prefix}/truncated_frac": float(np.mean([bool(e.get("truncated", False)) for e in episodes])),
    }


class EpisodeStatistics:
    """Moving-window episode statistics, pushed to the hub every ``report_every`` episodes.

    Plain class; the rollout manager wraps it as a Ray actor (``num_cpus=0``). ``logger_hub`` is the
    hub's actor handle, a plain ``LoggerHub`` (tests) or None (nothing is pushed).
    """

    def __init__(
        self, *, logger_hub: ActorHandle[LoggerHub] | LoggerHub | None = None, window: int = 100, report_every: int = 10
    ) -> None:
        setup_actor_logging()  # its records reach the console marked (runlog.py)
        if window < 1 or report_every < 1:
            raise ValueError(f"window and report_every must be >= 1; got window={window}, report_every={report_every}")
        self.logger_hub = logger_hub
        self.window = window
        self.report_every = report_every
        self._recent: deque[dict] = deque(maxlen=window)
        self._per_task: dict[str, deque[dict]] = {}
        self._task_counts: dict[str, int] = {}
        self._achievement_window: deque[dict[str, int]] = deque(maxlen=window)
        # Crafter episodes since the start, and in how many of them each achievement was unlocked.
        self._crafter_episodes = 0
        self._crafter_unlocked = dict.fromkeys(CRAFTER_ACHIEVEMENTS, 0)
        self._count = 0
        self._since_report = 0
        restart = actor_restart(EPISODE_STATISTICS)
        if restart is not None:
            count, name = restart
            log.warning(
                "the episode statistics actor %s died; Ray restarted it (restart %d, %s): its window of the last "
                "%d episodes died with it, the episode/* statistics start again from the episodes that finish now",
                name,
                count,
                RESTARTS_METRIC,
                window,
            )
            if logger_hub is not None:
                _call(logger_hub, "log_metrics", {RESTARTS_METRIC: float(count)})

    def add_episodes(self, records: list[dict]) -> None:
        for record in records:
            self._add(record)
            self._since_report += 1
            if self._since_report >= self.report_every:
                self._since_report = 0
                self.report(wait=False)

    def _add(self, record: dict) -> None:
        self._count += 1
        self._recent.append(record)
        task = record.get("task")
        if task is not None:
            self._per_task.setdefault(task, deque(maxlen=self.window)).append(record)
            self._task_counts[task] = self._task_counts.get(task, 0) + 1
        achievements = record.get("achievements")
        if achievements is not None:
            self._achievement_window.append(dict(achievements))
            if achievements.keys() & self._crafter_unlocked.keys():
                self._crafter_episodes += 1
                for name in CRAFTER_ACHIEVEMENTS:
                    self._crafter_unlocked[name] += achievements.get(name, 0) > 0

    def summary(self) -> dict[str, float]:
        """Every statistic over the current window; ``episode/count`` counts all episodes seen."""
        out: dict[str, float] = {"episode/count": float(self._count)}
        out.update(_window_stats("episode", self._recent))
        for task, episodes in self._per_task.items():
            name = _metric_name(task)
            out.update(_window_stats(f"episode/{name}", episodes))
            out[f"episode/{name}/count"] = float(self._task_counts[task])
        out.update(self._achievement_summary())
        return out

    def _achievement_summary(self) -> dict[str, float]:
        episodes = list(self._achievement_window)
        if not episodes:
            return {}
        names = set().union(*(e.keys() for e in episodes))
        out: dict[str, float] = {}

        def rate(name: str) -> float:
            return float(np.mean([e.get(name, 0) > 0 for e in episodes]))

        if names & set(CRAFTER_ACHIEVEMENTS):
            rates = {name: rate(name) for name in CRAFTER_ACHIEVEMENTS}
            out.update({f"crafter/success/{name}": r for name, r in rates.items()})
            out["crafter/score"] = crafter_score(100.0 * r for r in rates.values())
            out["crafter/achievements_per_episode"] = float(
                np.mean([sum(e.get(n, 0) > 0 for n in CRAFTER_ACHIEVEMENTS) for e in episodes])
            )
        if self._crafter_episodes:
            total = self._crafter_episodes
            out["crafter/all_episodes/count"] = float(total)
            out.update(
                {f"crafter/all_episodes/success/{name}": n / total for name, n in self._crafter_unlocked.items()}
            )
            out["crafter/all_episodes/score"] = crafter_score(
                100.0 * n / total for n in self._crafter_unlocked.values()
            )
        for name in sorted(names - set(CRAFTER_ACHIEVEMENTS)):
            out[f"achievement/success/{_metric_name(name)}"] = rate(name)
        return out

    def report(self, *, wait: bool = True) -> dict[str, float]:
        """Push the summary (and a histogram of window returns) to the hub; returns the summary. Called by
        the manager (its last report, at shutdown), it returns once the hub has logged them: the driver
        finishes the hub right after, and Ray orders only one caller's calls, so unwaited they could land
        after the finish. The reports every ``report_every`` episodes do not wait."""
        summary = self.summary()
        hub = self.logger_hub
        if hub is not None:
            returns = np.array([float(e["return"]) for e in self._recent], dtype=np.float32)
            sent = [_call(hub, "log_metrics", summary)]
            if returns.size:
                sent.append(_call(hub, "log_histogram", "episode/return", returns))
            if wait and hasattr(hub.log_metrics, "remote"):  # a plain hub (tests) has logged them already
                import ray

                ray.get(sent, timeout=30)
        return summary


def _call(hub: ActorHandle[LoggerHub] | LoggerHub, method: str, *args: Any) -> Any:
    """Fire-and-forget on an actor handle (its ``ObjectRef`` returned); a direct call on a plain object."""
    fn = getattr(hub, method)
    remote = getattr(fn, "remote", None)
    return remote(*args) if remote is not None else fn(*args)
