# mypy: ignore-errors
"""Train tiny scikit-learn models for the MLServer integration tests.

Run by `meshd.testing.mlserver.train_sklearn_models` with the MLServer venv's python (it needs
numpy, scikit-learn and joblib, none of which are in meshd's venv), so it must not import meshd:

    python _train_sklearn.py OUT_DIR COUNT MANIFEST

Model i is a 3-class LogisticRegression over 4 float features, trained on random data from
seed i, whose class labels are 10*i, 10*i+1 and 10*i+2: no two models can give the same answer,
so a test sees at once which model served a request. Each model goes to
OUT_DIR/sklearn-<i>/model.joblib (no model-settings.json: whoever serves it writes that); the
manifest (JSON) lists, per model, its name, folder, a few test inputs and model.predict's answers.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import joblib
import numpy as np
from sklearn.linear_model import LogisticRegression

FEATURES = 4
CLASSES = 3
TRAIN_ROWS = 60
TEST_ROWS = 4


def train(index: int, out_dir: Path) -> dict[str, object]:
    rng = np.random.default_rng(index)
    weights = rng.normal(size=(FEATURES, CLASSES))
    x = rng.normal(size=(TRAIN_ROWS, FEATURES))
    y = np.argmax(x @ weights, axis=1)
    y[:CLASSES] = np.arange(CLASSES)  # every class present, whatever the draw
    model = LogisticRegression().fit(x, 10 * index + y)
    name = f"sklearn-{index}"
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    joblib.dump(model, folder / "model.joblib")
    inputs = np.round(rng.normal(size=(TEST_ROWS, FEATURES)), 3)
    return {
        "name": name,
        "path": str(folder),
        "inputs": inputs.tolist(),
        "expected": [int(v) for v in model.predict(inputs)],
    }


def main() -> None:
    out_dir, count, manifest = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    models = [train(i, out_dir) for i in range(count)]
    manifest.write_text(json.dumps(models, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
