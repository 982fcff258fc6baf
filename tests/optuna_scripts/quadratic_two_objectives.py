"""In the shape of Optuna's examples: two quadratics, one minimised, one maximised; the
Pareto front printed after the search. Run as ``python quadratic_two_objectives.py N``."""

import sys

import optuna


def objective(trial):
    x = trial.suggest_float("x", -10, 10)
    y = trial.suggest_categorical("y", [-1, 0, 1])
    return x**2 + y, -((x - 2) ** 2 + y)


if __name__ == "__main__":
    n_trials = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    study = optuna.create_study(directions=["minimize", "maximize"])
    study.optimize(objective, n_trials=n_trials, timeout=600)
    print("Number of finished trials:", len(study.trials))
    for best in study.best_trials:
        print(f"Pareto trial #{best.number}: values {best.values}")
