"""Policy search and experiment tracking: Optuna studies over the dynamic knobs, MLflow runs, ``confkv-tune``."""
