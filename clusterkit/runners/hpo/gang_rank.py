"""Rank side of a gang trial: the objective in one rank process, its trial answered by the driver.

Runs inside a DDP rank process (:mod:`clusterkit.runners.ddp.rank`), with torchrun's environment
set. The objective gets an ``optuna.Trial`` whose ``suggest_*`` ask the driver, which samples each
parameter once and gives every rank the same value. Rank 0's reports, user attributes and result
are the trial's; ``should_prune`` asks the driver on every rank, which decides on rank 0's values
and gives each rank the same answer for the same step. Objectives written for Optuna's
``TorchDistributedTrial`` run unchanged (:func:`_accept_distributed_trials`), and a rank process
kept for the next trial starts it with fresh state in the modules that cached a process group.
``hpo.should_checkpoint()`` asks the driver (the same answer on every rank at the same call) and
SIGTERM is noted, not fatal, unless the objective traps it itself (:mod:`.gang_preemption`).
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import time
from types import ModuleType
from typing import Any

import cloudpickle
import optuna
from optuna.distributions import BaseDistribution, distribution_to_json, json_to_distribution
from optuna.pruners import BasePruner
from optuna.samplers import BaseSampler
from optuna.trial import FrozenTrial, TrialState

from clusterkit.runners.hpo import remote
from clusterkit.runners.hpo.inputs import ATTR_RETRY_OF
from clusterkit.runners.hpo.mirror import TrialView
from clusterkit.runners.hpo.retried import RetryAwareTrial

logger = logging.getLogger(__name__)


class DriverLink:
    """One rank's messages to the driver: events on the search's topic, answers by Queue."""

    def __init__(self, ctx: Any, info: dict[str, Any]) -> None:
        self.ctx = ctx
        self.rank: int = ctx.rank
        self.topic: str = info["topic"]
        self.head = {"number": info["number"], "attempt": info["attempt"], "rank": self.rank}
        self.reply = f"{self.topic}-g{info['number']}-{info['attempt']}-r{self.rank}"
        self.fixed = set(info["system_attrs"].get("fixed_params", {}))  # an enqueued trial's

    def send(self, kind: str, **fields: Any) -> None:
        self.ctx.relay(self.topic, {"kind": kind, **self.head, **fields})

    def ask(self, kind: str, **fields: Any) -> Any:
        event = {"kind": kind, **self.head, "reply": self.reply, **fields}
        return self.ctx.relay(self.topic, event, reply=self.reply)

    def call(self, method: str, *args: Any) -> Any:
        """A storage call on the driver's storage (:mod:`.remote`): its value, or its error."""
        return remote.result(self.ask("call", request=remote.request(method, args)))

    def write(self, kind: str, **fields: Any) -> None:
        """A write to the trial: rank 0's values and attributes; parameters are the driver's,
        but for an enqueued trial's fixed ones: every rank takes those itself, as Optuna does,
        and rank 0 reports them."""
        if self.rank != 0:
            return
        if kind != "param":
            self.send(kind, **fields)
        elif fields["name"] in self.fixed:
            self.send(kind, **{**fields, "dist": distribution_to_json(fields["dist"])})


class DriverSampler(BaseSampler):
    """Each parameter is the driver's sample, the same on every rank."""

    def __init__(self, link: DriverLink) -> None:
        self.link = link

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: Any) -> dict[str, Any]:
        return {}

    def sample_independent(
        self, study: Any, trial: Any, param_name: str, param_distribution: BaseDistribution
    ) -> Any:
        dist = distribution_to_json(param_distribution)
        answer = self.link.ask("suggest", name=param_name, dist=dist)
        if "error" in answer:
            raise ValueError(f"suggesting {param_name!r}: {answer['error']}")
        return answer["value"]


class RankPruner(BasePruner):
    """Asks the driver, which decides on rank 0's intermediate values; every rank is told the
    same for the same step."""

    def __init__(self, link: DriverLink) -> None:
        self.link = link

    def prune(self, study: Any, trial: FrozenTrial) -> bool:
        step = trial.last_step
        values = None
        if self.link.rank == 0:
            values = [[int(k), float(v)] for k, v in trial.intermediate_values.items()]
        answer = self.link.ask("prune", step=-1 if step is None else step, intermediate=values)
        return bool(answer)


def _trial(info: dict[str, Any], link: DriverLink) -> optuna.Trial:
    """A trial with the parameters the driver sampled before launch, the rest asked for; the
    study's other trials are read from the driver (a rank keeps no mirror)."""
    import datetime
    import pickle

    distributions = {k: json_to_distribution(v) for k, v in info["distributions"].items()}
    own = FrozenTrial(
        number=info["number"],
        state=TrialState.RUNNING,
        value=None,
        datetime_start=datetime.datetime.now(),
        datetime_complete=None,
        params=dict(info["params"]),
        distributions=distributions,
        user_attrs={} if info["series"] == info["number"] else {ATTR_RETRY_OF: info["series"]},
        system_attrs=dict(info["system_attrs"]),  # an enqueued trial's fixed_params: taken
        intermediate_values={},
        trial_id=info["trial_id"],
    )
    facts = pickle.loads(info["study"])
    view = TrialView(None, own, facts, link.write, link.call)
    study = optuna.Study(facts.name, view, sampler=DriverSampler(link), pruner=RankPruner(link))
    setattr(study, "stop", functools.partial(link.send, "stop"))  # noqa: B010  the search's
    return RetryAwareTrial(study, own._trial_id, lambda: info["attempt"] > 1)


_context: list[Any] = []  # the running trial's rank context, while its objective runs
_trials: list[optuna.Trial] = []  # the running trial's, as the objective gets it
_imported: set[str] = set()  # the modules this process held before its first trial


def _stale_modules() -> list[ModuleType]:
    """Modules imported by a trial of this process whose globals hold a process group: every
    group is destroyed when a trial ends, so a library that caches one (Optuna's
    ``TorchDistributedTrial`` keeps its group in a module global) would use a dead group."""
    from torch.distributed import ProcessGroup

    stale = []
    for name, module in list(sys.modules.items()):
        if name in _imported or not isinstance(module, ModuleType):
            continue
        if any(isinstance(value, ProcessGroup) for value in list(vars(module).values())):
            stale.append(module)
    return stale


def _fresh_module_state() -> None:
    """Before a trial: the first takes note of the modules the process held; each later one
    executes the modules its predecessors left a process group in again, in the namespace the
    objective's functions and classes still refer to, so they see the state a fresh process
    would give them (a reused rank process serves the search's next trial)."""
    if not _imported:
        _imported.update(sys.modules)
        return
    for module in _stale_modules():
        try:
            importlib.reload(module)
        except Exception as error:  # its groups at least go: None is what a fresh import binds
            logger.debug("reloading %s failed (%s); clearing its process groups", module, error)
            _clear_groups(module)


def _clear_groups(module: ModuleType) -> None:
    from torch.distributed import ProcessGroup

    for name, value in list(vars(module).items()):
        if isinstance(value, ProcessGroup):
            setattr(module, name, None)


def _accept_distributed_trials() -> None:
    """Optuna's distributed-trial convention: ``TorchDistributedTrial(trial)`` wants the trial on
    rank 0 and None on the others, and a process group. Every rank's objective gets a trial, so
    on the others the one it got becomes None; and where the objective leaves the group to its
    launcher (as Optuna's example does in its ``__main__``), the default group is initialised
    from torchrun's environment. Done once per process, where optuna-integration is installed."""
    try:
        from optuna_integration.pytorch_distributed import pytorch_distributed as module
    except ImportError:
        return
    original = module.TorchDistributedTrial.__init__
    if getattr(original, "_clusterkit", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, trial: Any, group: Any = None, *args: Any, **kwargs: Any) -> None:
        import torch.distributed as dist

        if _context and trial is not None and _trials and trial is _trials[-1]:
            if group is None and not dist.is_initialized():
                dist.init_process_group(_context[-1].backend)
            if _context[-1].rank != 0:
                trial = None
        original(self, trial, group, *args, **kwargs)

    __init__._clusterkit = True  # type: ignore[attr-defined]
    module.TorchDistributedTrial.__init__ = __init__  # type: ignore[method-assign]


def rank_context() -> Any:
    """In a multi-rank trial's objective: this rank's context (``rank``, ``world_size``,
    ``device``, ``save_checkpoint(state)``, ``load_checkpoint()``), as ``ddp.run`` gives its
    function; checkpoints go to the search's ``checkpoint_dir``, a folder per trial, and a
    retried trial resumes from them."""
    if not _context:
        raise RuntimeError("rank_context() is for the objective of a trial with ranks_per_trial")
    return _context[-1]


class CheckpointAsk:
    """``hpo.should_checkpoint()`` in a rank: the driver's answer for this rank's n-th call,
    the same on every rank (:mod:`.gang_preemption`). SIGTERM (the driver's, or the batch
    system's) is noted, not fatal, while the objective has no handler of its own."""

    def __init__(self, link: DriverLink) -> None:
        self.link = link
        self.calls = 0
        self.signalled = False

    def __call__(self) -> bool:
        self.calls += 1
        return bool(self.link.ask("checkpoint", call=self.calls, signalled=self.signalled))

    def noted(self, signum: int, frame: Any) -> None:
        self.signalled = True


def run_rank(ctx: Any, objective_blob: bytes, info: dict[str, Any]) -> dict[str, Any]:
    """Run the objective as this rank of the trial; rank 0's record is the trial's result.

    An exception propagates: the driver ends every rank of the trial and retries it whole.
    """
    import signal

    from clusterkit.runners.hpo.preemption import trial_context

    _fresh_module_state()
    _accept_distributed_trials()
    link = DriverLink(ctx, info)
    trial = _trial(info, link)
    objective = cloudpickle.loads(objective_blob)
    record: dict[str, Any] = {"number": info["number"], "error": None, "exception": None}
    start = time.time()
    _context.append(ctx)
    _trials.append(trial)
    asks = CheckpointAsk(link)
    previous = signal.signal(signal.SIGTERM, asks.noted)
    try:
        with trial_context(info["series"], info.get("checkpoint_dir"), None, asks):
            record.update(state=TrialState.COMPLETE.name, values=objective(trial))
    except optuna.TrialPruned:
        record.update(state=TrialState.PRUNED.name, values=None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _context.pop()
        _trials.pop()
    frozen = trial.storage.get_trial(trial._trial_id)
    record.update(
        params={},  # the driver sampled them and holds them
        distributions={},
        intermediate={int(k): float(v) for k, v in frozen.intermediate_values.items()},
        user_attrs=dict(frozen.user_attrs) if ctx.rank == 0 else {},
        system_attrs=dict(frozen.system_attrs) if ctx.rank == 0 else {},
        start=start,
        end=time.time(),
    )
    return record
