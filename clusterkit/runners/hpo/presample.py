"""A queued trial's parameters sampled on the driver while it waits, not in its slot.

A trial queued behind a running one (the lookahead) would sample when it starts, from the study
as it was when it was sent: its mirror delta. The driver, idle meanwhile, samples it at once
from that same study, so the worker starts the objective without the sampler's milliseconds
(TPE's multivariate sampling, Optuna 5's default: about 7 ms of each 0.5 s trial's slot for
four parameters, on the benchmark).

Drawn ahead, for TPE and random sampling (:data:`DRAWABLE`), by the driver's own copy of the
sampler: the relative search space it infers and its values (multivariate TPE, Optuna 5's
default), or else each parameter of the last finished trial, one at a time. On the
worker, :class:`PresampledSampler` answers from those values only where the objective asks for
the very same search space or distribution; anything else (a new parameter, a range that depends
on another value) is sampled there as before. The driver draws only while it is idle enough:
when drawing costs less than :data:`IDLE_SHARE` of the time between two finished trials, so a
sampler too slow for the trial rate (TPE over a large study at many slots, where the driver
bounds the throughput) keeps sampling on the workers, in parallel.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from optuna.distributions import BaseDistribution
from optuna.samplers import BaseSampler, QMCSampler, RandomSampler, TPESampler

from clusterkit.runners.hpo import inputs

#: Off: every trial samples on its worker (bench/hpo.py's "no presampling" side).
ENABLED = True
#: Samplers drawn ahead: what they draw depends on the study alone. Others (CMA-ES, NSGA-II,
#: GP, a user's own) keep sampling on the worker.
DRAWABLE = (TPESampler, RandomSampler)
#: Samplers drawn on the driver for every trial, whatever it costs: each draw counts on in the
#: study (QMC's sample id, a study system attribute read then written), which trials drawing at
#: once on their workers would read alike and draw the same point.
SEQUENTIAL = (QMCSampler,)
#: Share of the driver's time between two finished trials that drawing ahead may take.
IDLE_SHARE = 0.2
#: Weight of the newest measurement in the running means of cost and gap.
WEIGHT = 0.2


@dataclass
class Drawn:
    """One trial's values drawn ahead: the relative search space and its values, and values of
    single parameters by name (with the distribution each was drawn from)."""

    space: dict[str, BaseDistribution] = field(default_factory=dict)
    relative: dict[str, Any] = field(default_factory=dict)
    independent: dict[str, tuple[BaseDistribution, Any]] = field(default_factory=dict)


class PresampledSampler(BaseSampler):
    """``base``, except where ``drawn`` holds the answer (same space, same distribution)."""

    def __init__(self, base: BaseSampler, drawn: Drawn):
        self.base = base
        self.drawn = drawn

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, BaseDistribution]:
        if self.drawn.space:
            return dict(self.drawn.space)
        return self.base.infer_relative_search_space(study, trial)

    def sample_relative(self, study: Any, trial: Any, search_space: Any) -> dict[str, Any]:
        if search_space and search_space == self.drawn.space:
            return dict(self.drawn.relative)
        return self.base.sample_relative(study, trial, search_space)

    def sample_independent(
        self, study: Any, trial: Any, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        drawn = self.drawn.independent.get(param_name)
        if drawn is not None and drawn[0] == param_distribution:
            return drawn[1]
        return self.base.sample_independent(study, trial, param_name, param_distribution)

    def before_trial(self, study: Any, trial: Any) -> None:
        self.base.before_trial(study, trial)

    def after_trial(self, study: Any, trial: Any, state: Any, values: Sequence[float] | None):
        self.base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.base.reseed_rng()


class Presampler:
    """The driver's side: learns the parameters from finished trials, draws ahead for queued
    ones while that is cheap, and hands each trial's task its sampler."""

    def __init__(self, study: Any) -> None:
        self.study = study
        # its own copy: a sampler keeps state bound to the study it samples (TPE's intersection
        # search space keeps the study's id), and the tasks' copies must start clean
        self.always = type(study.sampler) in SEQUENTIAL
        drawable = self.always or type(study.sampler) in DRAWABLE
        self.sampler = pickle.loads(pickle.dumps(study.sampler)) if drawable else None
        if self.sampler is not None:  # its own random stream, not the state a task may carry
            self.sampler.reseed_rng()
        self.space: dict[str, BaseDistribution] = {}
        self.drawn: dict[int, Drawn] = {}
        self.cost = 0.0  # seconds per trial drawn ahead (running mean)
        self.gap: float | None = None  # seconds between finished trials (running mean)
        self._last_finish: float | None = None

    def finished(self, trial: Any) -> None:
        """A trial finished: its distributions are the parameters to draw, its time the gap."""
        self.drawn.pop(trial._trial_id, None)
        if trial.distributions:
            self.space = dict(trial.distributions)
        now = time.monotonic()
        if self._last_finish is not None:
            self.gap = _mean(self.gap, now - self._last_finish)
        self._last_finish = now

    def draw(self, trial_id: int) -> None:
        """Sample queued trial ``trial_id``'s parameters now, if the driver can afford it (a
        :data:`SEQUENTIAL` sampler: any trial's, always)."""
        if self.sampler is None or not ENABLED or not self.space:
            return
        if not self.always and (self.gap is None or self.cost > IDLE_SHARE * self.gap):
            if self.gap is not None:  # a later trial tries again, should trials get longer
                self.cost *= 1 - WEIGHT / 10
            return
        began = time.perf_counter()
        study, sampler = self.study, self.sampler
        trial = inputs.storage_of(study).get_trial(trial_id)
        drawn = Drawn(sampler.infer_relative_search_space(study, trial))
        if drawn.space:
            drawn.relative = sampler.sample_relative(study, trial, drawn.space)
        else:
            drawn.independent = {
                name: (dist, sampler.sample_independent(study, trial, name, dist))
                for name, dist in self.space.items()
            }
        self.drawn[trial_id] = drawn
        self.cost = _mean(self.cost, time.perf_counter() - began)

    def sampler_for(self, trial_id: int) -> BaseSampler:
        drawn = self.drawn.get(trial_id)
        return self.study.sampler if drawn is None else PresampledSampler(self.study.sampler, drawn)


def _mean(old: float | None, new: float) -> float:
    return new if not old else (1 - WEIGHT) * old + WEIGHT * new
