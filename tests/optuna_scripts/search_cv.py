"""In the shape of Optuna's OptunaSearchCV example: the library calls ``study.optimize``
itself, on scikit-learn's iris."""

import optuna
from optuna_integration import OptunaSearchCV
from sklearn.datasets import load_iris
from sklearn.svm import SVC

if __name__ == "__main__":
    param_distributions = {
        "C": optuna.distributions.FloatDistribution(1e-3, 1e3, log=True),
        "degree": optuna.distributions.IntDistribution(1, 5),
    }
    search = OptunaSearchCV(
        SVC(gamma="auto"), param_distributions, n_trials=12, timeout=600, random_state=0
    )
    X, y = load_iris(return_X_y=True)
    search.fit(X, y)
    print("trials:", len(search.study_.trials))
    print("best score:", round(search.best_score_, 3))
    print("workers:", len({t.user_attrs.get("ck_worker") for t in search.study_.trials}))
