"""``hydra/sweeper=study``: an Optuna study as a Hydra sweep that keeps what it found
(configs/hydra/sweeper/study.yaml; configs/hparams_search/ select it).

Why not hydra-optuna-sweeper's own sweeper: a failed trial ended its whole study in a
traceback (Optuna refuses the missing value a failed job returns, then the FAIL the
sweeper tells with values), its results were written only once every trial had run, and
its direction was a setting of its own, so ``optimized_metric=val/loss`` kept the highest
loss. This sweeper keeps that package's reading of the search space (``interval``,
``choice``, ``tag(log, ...)``) and Optuna's sampler, and runs the loop itself:

- the direction is the metric's (:data:`vit_mnist.settings.SEARCH_METRICS`: ``minimize``
  for ``val/loss``), said in the study's first line; an ``optimized_metric`` that is not a
  search metric is one line (exit status 2) before any trial;
- a trial whose job failed is told to Optuna as ``FAIL`` and the study goes on; the job's
  ``failed.json`` records why (the job writes it for a user error, this sweeper for any
  other exception), so the command exits 1 after the study, whichever launcher ran it;
- ``<sweep dir>/optimization_results.yaml`` is written after every trial, atomically: a
  study stopped by Ctrl-C or a crash keeps the trials it finished;
- with a ``pruner`` (Optuna's median pruner, Hyperband), each trial's run reports its
  ``optimized_metric`` after every validation and stops when the pruner says so
  (:class:`vit_mnist.training.callbacks.trial_pruning.TrialPruning`); the trial is told as
  ``PRUNED``.

Hydra instantiates sweepers from the ``hydra_plugins`` package only; hence this package.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)

RESULTS_FILE = "optimization_results.yaml"


class StudySweeper(Sweeper):
    """Run ``n_trials`` training jobs, each with parameters that Optuna's ``sampler`` draws
    from ``params`` (Hydra's sweep syntax), ``n_jobs`` at a time through the launcher.

    Args:
        sampler: an Optuna sampler's config (``_target_: optuna.samplers.TPESampler``),
            built by :func:`build_optuna` once checked, or a sampler.
        n_trials: trials in all, failed ones included.
        n_jobs: trials launched together (in parallel with ``hydra/launcher=joblib``).
        study_name: the study's name in the results file; None: Optuna's.
        params: ``{key: sweep}``, e.g. ``{"module.lr": "tag(log, interval(5e-4, 1e-2))"}``;
            sweeps given on the command line (``model.num_heads=choice(2,4)``) join them.
        pruner: an Optuna pruner's config (``optuna.pruners.MedianPruner``), built as the
            sampler is, a pruner, or None for none. It needs ``n_jobs=1`` and Hydra's
            basic launcher: the trial is handed to its run in this process.
    """

    def __init__(
        self,
        sampler: Any,
        n_trials: int,
        n_jobs: int,
        study_name: str | None = None,
        params: DictConfig | None = None,
        pruner: Any = None,
    ) -> None:
        self.sampler = sampler
        self.pruner = pruner
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.study_name = study_name
        self.params = params or {}

    def setup(
        self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig
    ) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> list[JobReturn]:
        """Run the study; returns the jobs' results.

        Raises:
            ConfigError: before the first trial: ``optimized_metric`` is not one of the
                search metrics; ``n_trials`` or ``n_jobs`` below 1 (:func:`check_study`); a
                sampler or pruner that :func:`build_optuna` refuses; a ``pruner`` with
                ``n_jobs`` above 1 or another launcher than the basic one; a search space
                that :func:`search_space` refuses; a pruner that would never prune
                (:func:`check_pruner_warmup`).
        """
        import optuna
        from hydra._internal.core_plugins.basic_launcher import BasicLauncher

        from vit_mnist.errors import ConfigError
        from vit_mnist.settings import SEARCH_METRICS
        from vit_mnist.training.callbacks.trial_pruning import running_trial

        metric = self.config.get("optimized_metric")
        if metric not in SEARCH_METRICS:
            shown = "null" if metric is None else metric
            raise ConfigError(
                f"optimized_metric={shown} is not a metric an Optuna study can optimise; "
                f"use one of {list(SEARCH_METRICS)}, e.g. optimized_metric=val/acc_best"
            )
        direction = SEARCH_METRICS[metric]
        check_study(
            n_trials=self.n_trials,
            n_jobs=self.n_jobs,
            study_name=self.study_name,
            params=OmegaConf.to_container(self.params) if OmegaConf.is_config(self.params) else {},
        )
        sampler = build_optuna(self.sampler, "sampler", optuna.samplers.BaseSampler)
        pruner = build_optuna(self.pruner, "pruner", optuna.pruners.BasePruner)
        if pruner is not None and (
            self.n_jobs != 1 or not isinstance(self.launcher, BasicLauncher)
        ):
            raise ConfigError(
                f"hydra.sweeper.pruner needs one trial at a time in this process, and got "
                f"hydra.sweeper.n_jobs={self.n_jobs} with {type(self.launcher).__name__}; set "
                "hydra.sweeper.n_jobs=1 and keep hydra/launcher=basic, or hydra.sweeper.pruner=null"
            )
        space, fixed = search_space(
            [*(f"{k}={v}" for k, v in self.params.items()), *arguments], self.config
        )
        check_pruner_warmup(pruner, self.config)
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # our own line per trial
        study = optuna.create_study(
            study_name=self.study_name,
            sampler=sampler,
            direction=direction,
            pruner=pruner or optuna.pruners.NopPruner(),  # Optuna's None is its median
        )
        if pruner is not None:
            fixed["+callbacks.trial_pruning._target_"] = (
                "vit_mnist.training.callbacks.trial_pruning.TrialPruning"
            )
            fixed["+callbacks.trial_pruning.monitor"] = metric
        results = Path(self.config.hydra.sweep.dir) / RESULTS_FILE
        log.info(
            "Optuna study %s: %d trials, each to %s %s; results after every trial in %s",
            study.study_name,
            self.n_trials,
            direction,
            metric,
            results,
        )
        returns: list[JobReturn] = []
        try:
            while len(returns) < self.n_trials:
                trials = [
                    study.ask(space) for _ in range(min(self.n_jobs, self.n_trials - len(returns)))
                ]
                batch = [
                    tuple(f"{k}={v}" for k, v in {**t.params, **fixed}.items()) for t in trials
                ]
                with running_trial(trials[0] if pruner is not None else None):
                    launched = self.launcher.launch(batch, initial_job_idx=len(returns))
                for trial, job in zip(trials, launched, strict=True):
                    value = _trial_value(job, metric)
                    if value is None:
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    elif pruner is not None and trial.should_prune():
                        # What the run's TrialPruning saw after its last epoch (no other trial
                        # ended since), so a run that trailed in its last epoch is PRUNED too,
                        # as Optuna's own Lightning callback has it.
                        epochs = study.trials[trial.number].last_step + 1
                        log.info("trial %d pruned after %d epochs", trial.number, epochs)
                        study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                    else:
                        study.tell(trial, value)
                    returns.append(job)
                write_results(study, metric, direction, returns, results)
        except BaseException:
            # Ctrl-C, SIGTERM or a crash of this process: the file holds every trial that ended.
            log.warning(
                "The study stopped after %d of %d trials; %s holds them",
                len(returns),
                self.n_trials,
                results if returns else "no file",
            )
            raise
        return returns


# What each of the study's Optuna parts is, with an example, for the one-line errors.
_OPTUNA_PARTS = {
    "sampler": "{_target_:optuna.samplers.TPESampler,seed:1}",
    "pruner": "{_target_:optuna.pruners.MedianPruner,n_warmup_steps:4}",
}


def check_study(**values: Any) -> None:
    """Check ``hydra.sweeper``'s own settings ``values`` (``n_trials`` >= 1, ``n_jobs`` >= 1,
    ...) against :class:`vit_mnist.settings.StudySettings`, before the first trial.

    Raises:
        ConfigError: one line naming the key, the value and a valid example.
    """
    from vit_mnist.settings import StudySettings, check_arguments

    check_arguments(StudySettings, values, prefix="hydra.sweeper.")


def build_optuna(node: Any, name: str, base: type) -> Any:
    """The study's ``sampler`` or ``pruner`` (``name``) built from its config ``node`` (a
    section with a ``_target_``), checked first: the target imports, takes each key as an
    argument, accepts the values, and is an Optuna ``base`` (a sampler or pruner class).
    ``node`` may be None (no pruner) or an object built already (a Python caller's).

    Raises:
        ConfigError: one line naming ``hydra.sweeper.<name>`` and the form that works.
    """
    if node is None or isinstance(node, base):
        return node
    from hydra.utils import instantiate

    from vit_mnist.errors import ConfigError
    from vit_mnist.settings import check_target

    key, example = f"hydra.sweeper.{name}", _OPTUNA_PARTS[name]
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    if not isinstance(values, dict) or "_target_" not in values:
        raise ConfigError(f"{key} needs a _target_ (an Optuna {name} class): '{key}={example}'")
    check_target(key, values)  # imports it; every key one of its arguments
    try:
        built = instantiate(values)
    except Exception as e:  # noqa: BLE001 - whatever the class refuses, in one line
        cause = e.__cause__ or e
        raise ConfigError(
            f"{key}: {values['_target_']} refuses its arguments ({' '.join(str(cause).split())})"
            f"; fix them, e.g. '{key}={example}'"
        ) from None
    if not isinstance(built, base):
        raise ConfigError(
            f"{key}._target_={values['_target_']} is not an Optuna {name}; use one of "
            f"{base.__module__.rsplit('.', 1)[0]}'s, e.g. '{key}={example}'"
        )
    return built


def check_pruner_warmup(pruner: Any, config: DictConfig) -> None:
    """A pruner whose warm-up (``n_warmup_steps``, in epochs: each trial reports once per
    validation, the epoch as the step) lasts as long as a trial, which would never prune.

    Raises:
        ConfigError: naming both settings and the fix.
    """
    from vit_mnist.errors import ConfigError

    warmup = getattr(pruner, "_n_warmup_steps", None)  # Median, Percentile, Threshold pruners
    epochs = OmegaConf.select(config, "trainer.max_epochs")
    if isinstance(warmup, int) and isinstance(epochs, int) and warmup >= epochs:
        raise ConfigError(
            f"hydra.sweeper.pruner.n_warmup_steps={warmup}: the pruner may stop a trial from "
            f"epoch {warmup} on, and each trial runs trainer.max_epochs={epochs} (epochs 0 to "
            f"{epochs - 1}), so it would never prune; lower n_warmup_steps below {epochs}, "
            "or turn the pruner off with hydra.sweeper.pruner=null"
        )


def search_space(overrides: list[str], config: DictConfig) -> tuple[dict, dict]:
    """Optuna's distributions and the fixed values of ``overrides`` (``key=sweep`` in
    Hydra's syntax: the sweeper's ``params``, then the command line's), each sweep checked
    before the first trial: its key exists in ``config`` (or is added with ``+``), an
    ``interval`` has low < high (and bounds > 0 on a log scale), a ``range`` is not
    empty, and every bound and choice is a value the setting takes
    (:data:`vit_mnist.settings.TrainSettings`).

    Raises:
        ConfigError: one line echoing the entry as written, saying what is wrong and the
            form that works.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides

    from vit_mnist.errors import ConfigError
    from vit_mnist.hydra_errors import unknown_override
    from vit_mnist.settings import TrainSettings, check_value

    parser = OverridesParser.create()
    for raw in overrides:
        (override,) = parser.parse_overrides([raw])  # Hydra has read each one already
        key = override.key_or_group
        if not override.is_sweep_override():
            continue
        node = OmegaConf.select(config, key, default=_ABSENT)
        if node is _ABSENT and not override.is_add():
            line = unknown_override(key, [raw], "train")
            raise ConfigError(f"the search space's {raw}: {line}")
        problem, values = _sweep_values(override.value())
        if problem:
            raise ConfigError(f"the search space's {raw}: {problem}")
        if OmegaConf.is_config(node):
            continue  # a config group (model=choice(vit_tiny,cnn)): Hydra checks its options
        for value in values:
            try:
                check_value(TrainSettings, key, value)
            except ConfigError as e:
                whole = all(isinstance(v, float) and v.is_integer() for v in values)
                hint = " (interval draws real numbers: choice(...) or range(...) draws whole ones)"
                raise ConfigError(
                    f"the search space's {raw} draws a value the setting refuses: {e}"
                    + (hint if whole else "")
                ) from None
    return create_params_from_overrides(overrides)


_ABSENT = object()


def _sweep_values(sweep: Any) -> tuple[str | None, list[Any]]:
    """``(what is wrong with the sweep or None, the values to check against the schema:
    its bounds or choices)`` for Hydra's ``interval``, ``range`` or ``choice``."""
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    if isinstance(sweep, IntervalSweep):
        low, high = sweep.start, sweep.end
        if not low < high:
            return (
                f"interval(low, high) needs low < high; write interval({_num(min(low, high))}, "
                f"{_num(max(low, high))})"
                if low != high
                else f"low = high = {_num(low)} is one value: write the setting={_num(low)}"
            ), []
        if "log" in sweep.tags and low <= 0:
            return (
                f"a log scale needs bounds > 0, and the low bound is {_num(low)}; e.g. "
                f"tag(log, interval({_num(high / 100)}, {_num(high)}))"
            ), []
        return None, [low, high]
    if isinstance(sweep, RangeSweep):
        start, stop, step = sweep.start, sweep.stop, sweep.step or 1
        if (stop - start) * step <= 0:
            return f"range({_num(start)}, {_num(stop)}) holds no value; e.g. range(1, 5)", []
        return None, [sweep.start, sweep.stop]  # Optuna's IntUniformDistribution: stop too
    if isinstance(sweep, ChoiceSweep):
        return None, list(sweep.list)
    return None, []


def _num(x: float) -> str:
    return f"{x:g}"


def _trial_value(job: JobReturn, metric: str) -> float | None:
    """The metric a finished job returned; None, with its ``failed.json`` written, for a job
    that failed (which then has nothing to return) or returned no finite number."""
    from vit_mnist.errors import FAILED_FILE, record_failure

    job_dir = Path(job.hydra_cfg.hydra.runtime.output_dir)
    if job.status == JobStatus.FAILED:
        # The exception the job raised (JobReturn.return_value would raise it here).
        error = job._return_value
        log.error("trial %s failed", job_dir.name, exc_info=error)
        record_failure(job_dir, f"{type(error).__name__}: {error}", type(error).__name__)
        return None
    value = job.return_value
    if value is not None and math.isfinite(value):
        log.info("trial %s: %s = %.6g", job_dir.name, metric, value)
        return float(value)
    if not (job_dir / FAILED_FILE).is_file():
        record_failure(job_dir, f"{metric} is {value}", "ValueError")
    log.warning("trial %s failed; see %s", job_dir.name, job_dir / FAILED_FILE)
    return None


def write_results(
    study: Any, metric: str, direction: str, jobs: Sequence[JobReturn], path: Path
) -> None:
    """Write the study so far to ``path`` (YAML, atomically): ``metric``, ``direction``,
    ``best_value`` and ``best_params`` (null while no trial has completed), ``best_job``
    (its run dir) and ``trials``: each trial's number, state (``COMPLETE``, ``PRUNED``
    with the last value its run reported, or ``FAIL``), value, parameters and run dir."""
    from vit_mnist.io import atomic_write_bytes

    dirs = [str(j.hydra_cfg.hydra.runtime.output_dir) for j in jobs]
    done = [t for t in study.trials if t.state.name == "COMPLETE"]
    best = study.best_trial if done else None
    record = {
        "name": "optuna",
        "study_name": study.study_name,
        "metric": metric,
        "direction": direction,
        "best_value": best.value if best else None,
        "best_params": dict(best.params) if best else None,
        "best_job": dirs[best.number] if best else None,
        "trials": [
            {
                "number": t.number,
                "state": t.state.name,
                "value": t.value,
                "params": dict(t.params),
                "job": dirs[t.number],
            }
            for t in study.trials
            if t.number < len(dirs)
        ],
    }
    atomic_write_bytes(path, OmegaConf.to_yaml(OmegaConf.create(record)).encode())
