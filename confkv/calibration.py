"""Thresholds that fit the model: where a calibration is kept, and reading it back for the default policy.

``confkv calibrate`` (``confkv.bench.calibrate``) measures the model's own next-token signals and writes a policy
whose ``entropy_threshold`` and ``gap_threshold`` are quantiles of them.

The requirement's 3.5 nats and 0.15 are one model's numbers: a 135M model crosses 3.5 nats often, so under them
its budget sits near ``max_size`` and the rule saves little. Calibration reads a text with the full cache
(teacher-forced, so every token's distribution is the model's own with nothing evicted) and takes

* ``entropy_threshold``: the entropy that a fifth of the tokens exceed (quantile 0.8), and
* ``gap_threshold``: the top-1 minus top-2 probability that a fifth of the tokens fall below (quantile 0.2),

so each test alone calls a fifth of the tokens uncertain (together somewhat more, as the two are correlated; the
file records the share). Both quantiles are options (``--entropy-quantile``, ``--gap-quantile``).

The default text is documentation prose from the corpus's *train* split (``confkv.bench.corpus``): fitting two
numbers to the model is tuning, and tuning may read train text only; every held-out item of the benchmarks and
the tuner is drawn from the held-out split's topics, which share no paragraph with the train split, so the
calibration never reads text a held-out measurement uses. ``--text-file`` calibrates on any other text.

Where it is kept: ``$CONFKV_CACHE/calibration/<model>.yaml`` (default ``~/.cache/confkv``), or under the folder
``$CONFKV_CALIBRATION`` names (``off`` turns calibration off). When the file exists, the default policy for the
model (``LLM(model)``, ``LLM(model, "dynamic")``, ``confkv generate --policy dynamic``) takes its two thresholds
(``confkv.policy_source.resolve_policy``); a policy file, an explicit ``CachePolicy`` and explicit overrides still win.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import yaml

from confkv.config import load_policy_file
from confkv.errors import ConfkvError
from confkv.model_loader import cache_root, source_fingerprint

log = logging.getLogger(__name__)

CALIBRATED_KEYS = ("entropy_threshold", "gap_threshold")
_OFF = {"", "0", "off", "none", "false", "no"}


def calibration_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """Where calibrations are kept: ``$CONFKV_CALIBRATION`` when set (``off``: nowhere), else the cache's
    ``calibration`` folder."""
    env = os.environ.get("CONFKV_CALIBRATION")
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(env)
    return cache_root(cache_dir) / "calibration"


def model_slug(model: str) -> str:
    """A file name for a model: its name; a local folder or file by its name plus a hash of its absolute path."""
    if os.sep not in model and not Path(model).exists():
        return model
    path = str(Path(model).expanduser().resolve())
    return f"{Path(path).name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


def calibration_path(model: str, cache_dir: str | os.PathLike[str] | None = None) -> Path | None:
    folder = calibration_dir(cache_dir)
    return None if folder is None else folder / f"{model_slug(model)}.yaml"


def calibrated_thresholds(model: str, cache_dir: str | os.PathLike[str] | None = None) -> dict[str, float] | None:
    """The calibrated thresholds of ``model``, or None when it has no calibration (or calibration is off).

    A calibration file that does not load is an error rather than silently ignored: the default policy would
    otherwise change without a word.
    """
    path = calibration_path(model, cache_dir)
    if path is None or not path.is_file():
        return None
    try:
        policy = load_policy_file(path)
        measured = (yaml.safe_load(path.read_text()).get("calibration") or {}).get("weights")
    except (ConfkvError, OSError, yaml.YAMLError, AttributeError) as err:
        raise ConfkvError(f"{err} (the calibration of {model}: run `confkv calibrate` again or delete it)") from None
    if measured is not None and measured != source_fingerprint(model, cache_dir):
        log.warning("the calibration of %s (%s) was measured on other weights than the model's files now hold; "
                    "using the default thresholds until `confkv calibrate` runs again", model, path)  # fmt: skip
        return None
    return {k: getattr(policy, k) for k in CALIBRATED_KEYS}
