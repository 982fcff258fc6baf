"""In the shape of Optuna's pruning example: an SGD classifier on scikit-learn's iris (shipped
with scikit-learn, no download), reporting each epoch's score and pruned by the study's
MedianPruner; the study's statistics printed after the search."""

import optuna
import sklearn.datasets
import sklearn.linear_model
import sklearn.model_selection
from optuna.trial import TrialState


def objective(trial):
    iris = sklearn.datasets.load_iris()
    classes = list(set(iris.target))
    train_x, valid_x, train_y, valid_y = sklearn.model_selection.train_test_split(
        iris.data, iris.target, test_size=0.25, random_state=trial.number
    )
    alpha = trial.suggest_float("alpha", 1e-5, 1e-1, log=True)
    clf = sklearn.linear_model.SGDClassifier(alpha=alpha, random_state=0)
    for step in range(30):
        clf.partial_fit(train_x, train_y, classes=classes)
        trial.report(clf.score(valid_x, valid_y), step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return clf.score(valid_x, valid_y)


if __name__ == "__main__":
    pruner = optuna.pruners.MedianPruner(n_startup_trials=3, n_warmup_steps=5)
    study = optuna.create_study(direction="maximize", pruner=pruner)
    study.optimize(objective, n_trials=30)
    pruned = study.get_trials(deepcopy=False, states=[TrialState.PRUNED])
    complete = study.get_trials(deepcopy=False, states=[TrialState.COMPLETE])
    print("finished:", len(study.trials), "pruned:", len(pruned), "complete:", len(complete))
    print("best value:", study.best_trial.value)
