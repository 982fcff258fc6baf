"""In the shape of Optuna's examples: a constrained search with Optuna 5's
``trial.set_constraint`` (feasible when every constraint is <= 0), the best feasible trial
printed after the search."""

import optuna


def objective(trial):
    x = trial.suggest_float("x", -10, 10)
    y = trial.suggest_float("y", -10, 10)
    trial.set_constraint("c1", 1.0 - x * y)  # feasible: x * y >= 1
    return x**2 + y**2


if __name__ == "__main__":
    sampler = optuna.samplers.NSGAIISampler(seed=0, population_size=8)
    study = optuna.create_study(sampler=sampler)
    study.optimize(objective, n_trials=32)
    feasible = [
        t
        for t in study.trials
        if t.state == optuna.trial.TrialState.COMPLETE
        and all(v <= 0 for k, v in t.system_attrs.items() if k.startswith("constraints:"))
    ]
    generations = {t.system_attrs.get("NSGAIISampler:generation") for t in study.trials}
    print("feasible:", len(feasible), "of", len(study.trials))
    print("generations:", sorted(g for g in generations if g is not None))
    print("best feasible:", min(t.value for t in feasible))
