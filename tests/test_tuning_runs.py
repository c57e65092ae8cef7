"""Training runs through ``confkv-tune train`` on tiny-random (split from test_tuning.py): PPO/SAC/Optuna runs logged
to MLflow with their exports, presets and learning curves, warm starts, held-out choice of the export, decode mode,
seeded Optuna studies, and the eval/compare runs."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pandas as pd
import pytest

from confkv import LLM, SamplingParams
from confkv.config import load_policy_file
from confkv.controllers.learned import KnobSpace, MLPPolicy
from confkv.controllers.observation import OBS_DIM, OBS_NAMES
from tuner.cli import main as tune_main


@pytest.mark.parametrize("algo", ["ppo", "optuna"])
def test_train_logs_mlflow_and_exports_a_policy_confkv_runs(tmp_path, monkeypatch, capsys, algo):
    monkeypatch.chdir(tmp_path)
    budget = ["--timesteps", "64", "--n-envs", "2", "--eval-every", "1"] if algo == "ppo" else ["--trials", "3"]
    code = tune_main(["train", "--algo", algo, "--model", "tiny-random", *budget, "--out", "run"])
    assert code == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    policy_dir = tmp_path / "run" / "policy"
    policy = load_policy_file(policy_dir)
    assert policy.controller == ("learned" if algo == "ppo" else "dynamic")

    import mlflow
    import mlflow.pyfunc

    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    client = mlflow.MlflowClient()
    run = mlflow.get_run(summary["run_id"])
    assert run.data.params["algo"] == algo
    assert run.data.tags["mlflow.source.git.commit"] == run.data.tags["confkv.git_commit"] != ""
    assert run.data.params["space_max_size"] == "[32.0, 256.0]"  # the same space for both (tiny base: 32/128)
    key = "episode_reward" if algo == "ppo" else "trial_reward"
    assert len(client.get_metric_history(run.info.run_id, key)) >= (1 if algo == "ppo" else 3)
    names = {a.path for a in client.list_artifacts(run.info.run_id, "policy")}
    assert "policy/policy.yaml" in names
    if algo == "ppo":
        # the schedule is printed and logged; learning curves per update and per evaluation
        assert "64 timesteps = 2 updates of 32 segments" in captured.err
        assert run.data.params["ppo_updates"] == "2" and run.data.params["ppo_gradient_steps"] == "20"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "rollout/ep_rew_mean")] == [32, 64]
        evals = client.get_metric_history(run.info.run_id, "eval_reward")
        assert [m.step for m in evals] == [0, 32, 64]
        # before any update the agent is the base policy (the knob map is centred on it)
        assert evals[0].value == pytest.approx(run.data.metrics["default_reward"], abs=0.05)
        # the exported network is also an MLflow model, linked to the registry version it became
        model = mlflow.pyfunc.load_model(run.data.tags["confkv.pyfunc_model_uri"])
        assert model.metadata.metadata["confkv.registry.ref"] == summary["registry"]["ref"]
        obs = np.random.default_rng(0).random((5, OBS_DIM), dtype=np.float32)
        mlp = MLPPolicy.load(policy_dir)
        space = mlp.resolved_space(policy)
        expected = [space.knobs(mlp.act(o)) for o in obs]
        got = model.predict(pd.DataFrame(obs, columns=list(OBS_NAMES)))
        np.testing.assert_allclose(got.to_numpy(), pd.DataFrame(expected)[list(space.names)].to_numpy(), rtol=1e-6)
    else:
        import optuna

        study = optuna.load_study(study_name=run.data.tags["confkv.optuna_study"],
                                  storage=run.data.tags["confkv.optuna_storage"])  # fmt: skip
        first = study.trials[0]
        assert first.user_attrs["enqueued"] == "default"
        assert first.params == {"base_size": 32, "max_size": 128, "entropy_threshold": 3.5, "gap_threshold": 0.15,
                                "scaling_factor": 0.8}  # fmt: skip
        best = study.best_trial
        assert run.data.tags["confkv.best.max_size"] == str(best.params["max_size"])
        assert float(run.data.tags["confkv.best_value"]) == pytest.approx(best.value)

    # the exported policy, taken back out of MLflow, generates in the engine without stable-baselines3 code
    assert tune_main(["export", summary["run_id"], "--out", "exported"]) == 0
    exported = capsys.readouterr().out.strip()
    llm = LLM("tiny-random", policy_file=exported)
    out = llm.generate("The exported policy runs here. " * 12, SamplingParams(max_tokens=60, ignore_eos=True))[0]
    assert len(out.token_ids) == 60
    assert max(out.trace.resident[1:]) <= KnobSpace.for_policy(policy).budget_range(policy)[1] + 16


def _train_run(args: list[str], capsys) -> tuple[Any, dict, Any, list[float]]:
    """Run ``confkv-tune train`` (cwd: a temporary folder); its output, summary, MLflow run and evaluation rewards."""
    import mlflow

    assert tune_main(args) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    run = mlflow.get_run(summary["run_id"])
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "eval_reward")
    return captured, summary, run, [m.value for m in history]


def test_ppo_warm_started_from_a_tuned_policy_keeps_its_best_evaluation(tmp_path, monkeypatch, capsys):
    """``--init-policy``: the untrained agent is the given policy (its knobs are the space's centre, the bounds stay
    those searched around the base), and the export is the best evaluated policy, the untrained one included."""
    import yaml

    from envs.episodes import default_base_policy

    monkeypatch.chdir(tmp_path)
    base = default_base_policy("tiny-random")
    tuned = base.replace(entropy_threshold=2.0, gap_threshold=0.05, scaling_factor=0.9, base_size=48, max_size=64)
    (tmp_path / "tuned.yaml").write_text(yaml.safe_dump({"cache_policy": tuned.model_dump(mode="json")}))
    args = ["train", "--algo", "ppo", "--model", "tiny-random", "--timesteps", "64", "--n-envs", "2",
            "--eval-every", "1", "--out", "run", "--no-register", "--init-policy", "tuned.yaml",
            "--relative-reward", "--log-std-init", "-2"]  # fmt: skip
    captured, _, run, evals = _train_run(args, capsys)
    assert len(evals) == 3
    # before any update the agent is exactly the tuned policy (its mean's layer starts at zero), not the default rule
    assert evals[0] == pytest.approx(run.data.metrics["init_reward"], abs=1e-6)
    # trained on rewards relative to that policy's, evaluated on plain ones
    assert run.data.params["relative_reward"] == "True" and run.data.params["preset_log_std_init"] == "-2.0"
    assert run.data.metrics["reference_reward"] == pytest.approx(evals[0], abs=1e-6)
    assert run.data.params["init_max_size"] == "64" and run.data.params["space_max_size"] == "[32.0, 256.0]"
    # the exported network is the best evaluation's, said in the run
    assert run.data.metrics["selected_reward"] == pytest.approx(max(evals))
    assert evals[int(run.data.metrics["selected_updates"])] == pytest.approx(max(evals))
    assert "exported: the policy after" in captured.err
    loaded = MLPPolicy.load(tmp_path / "run" / "policy")
    assert loaded.space == KnobSpace.for_policy(tuned, bounds_of=base)
    assert loaded.space.knobs(np.zeros(5)) == {"entropy_threshold": 2.0, "gap_threshold": 0.05,
                                                "scaling_factor": 0.9, "base_size": 48, "max_size": 64}  # fmt: skip
    exported = load_policy_file(tmp_path / "run" / "policy")
    assert (exported.base_size, exported.max_size, exported.entropy_threshold) == (48, 64, 2.0)

    # refused: a policy that is not dynamic, one outside the searched space, and an agent that sets budgets
    (tmp_path / "full.yaml").write_text(yaml.safe_dump({"cache_policy": base.replace(controller="full")
                                                        .model_dump(mode="json")}))  # fmt: skip
    wide = base.replace(max_size=1024)
    (tmp_path / "wide.yaml").write_text(yaml.safe_dump({"cache_policy": wide.model_dump(mode="json")}))
    bad = ["train", "--algo", "ppo", "--model", "tiny-random", "--timesteps", "8", "--out", "x", "--no-register"]
    assert tune_main([*bad, "--init-policy", "full.yaml"]) == 2
    assert "must be a dynamic policy" in capsys.readouterr().err
    assert tune_main([*bad, "--init-policy", "wide.yaml"]) == 2
    assert "outside the searched space" in capsys.readouterr().err
    assert tune_main([*bad, "--init-policy", "tuned.yaml", "--action", "budget"]) == 2
    assert "knobs agent" in capsys.readouterr().err
    optuna = ["train", "--algo", "optuna", "--model", "tiny-random", "--trials", "1", "--out", "x", "--no-register"]
    assert tune_main([*optuna, "--relative-reward"]) == 2
    assert "--relative-reward is for ppo or sac" in capsys.readouterr().err


def test_sac_refines_a_tuned_policy_with_its_discount_and_no_random_warm_up(tmp_path, monkeypatch, capsys):
    """SAC through the CLI: ``--learning-starts 0`` explores around the start from the first step (no uniform
    draws over the whole box), ``--gamma`` and ``--ent-coef`` are the run's preset (which ``train_sb3`` hands to
    SB3), the untrained actor is exactly the tuned policy and the export is the best evaluation, the start included."""
    import yaml

    from envs.episodes import default_base_policy

    monkeypatch.chdir(tmp_path)
    tuned = default_base_policy("tiny-random").replace(entropy_threshold=2.0, base_size=48, max_size=64)
    (tmp_path / "tuned.yaml").write_text(yaml.safe_dump({"cache_policy": tuned.model_dump(mode="json")}))
    args = ["train", "--algo", "sac", "--model", "tiny-random", "--timesteps", "48", "--n-envs", "2",
            "--n-steps", "8", "--batch-size", "8", "--eval-every", "1", "--out", "run", "--no-register",
            "--init-policy", "tuned.yaml", "--relative-reward", "--gamma", "0.5", "--learning-starts", "0",
            "--ent-coef", "auto_0.01"]  # fmt: skip
    captured, _, run, evals = _train_run(args, capsys)
    assert run.data.params["preset_gamma"] == "0.5" and run.data.params["preset_learning_starts"] == "0"
    assert run.data.params["preset_ent_coef"] == "auto_0.01"
    assert "0 random first" in captured.err
    # evaluations are labelled in gradient steps, as the schedule is: one per vectorised step of 2 episodes
    assert "then one gradient step (batch 8) per step: 24 updates" in captured.err
    assert "after 24 updates (48 timesteps)" in captured.err
    assert evals[0] == pytest.approx(run.data.metrics["init_reward"], abs=1e-6)
    assert len(evals) == 4  # the start, every 8 vectorised steps, the end: not one per step
    assert run.data.metrics["selected_reward"] == pytest.approx(max(evals))
    assert load_policy_file(tmp_path / "run" / "policy").controller == "learned"
    bad = ["train", "--model", "tiny-random", "--out", "x", "--no-register"]
    assert tune_main([*bad, "--algo", "ppo", "--timesteps", "8", "--learning-starts", "0"]) == 2
    assert "--learning-starts is for sac" in capsys.readouterr().err
    assert tune_main([*bad, "--algo", "optuna", "--trials", "1", "--gamma", "0.5"]) == 2
    assert "--gamma, --ent-coef and --lr-schedule are for ppo or sac" in capsys.readouterr().err
    assert tune_main([*bad, "--algo", "ppo", "--timesteps", "8", "--ent-coef", "auto"]) == 2
    assert "--ent-coef must be a number" in capsys.readouterr().err
    assert tune_main([*bad, "--algo", "sac", "--timesteps", "8", "--gamma", "1.5"]) == 2
    assert "--gamma must be in [0, 1]" in capsys.readouterr().err


def test_ppo_chooses_its_export_on_held_out_training_items(tmp_path, monkeypatch, capsys):
    """``--validation-fraction``: the agent trains on the other items, and the evaluations that choose the export run
    on the held-out ones (the untrained agent's among them)."""
    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", "ppo", "--model", "tiny-random", "--timesteps", "64", "--n-envs", "2", "--eval-every",
            "1", "--out", "run", "--no-register", "--validation-fraction", "0.5", "--items-scale", "2"]  # fmt: skip
    captured, summary, run, evals = _train_run(args, capsys)
    assert run.data.params["validation_fraction"] == "0.5" and run.data.params["preset_validation_fraction"] == "0.0"
    assert run.data.metrics["validation_episodes"] == 6 and len(evals) == 3  # half of each kind's two
    assert evals[0] == pytest.approx(run.data.metrics["validation_start_reward"], abs=0.05)
    assert run.data.metrics["selected_reward"] == pytest.approx(max(evals))
    assert "held out to choose the export" in captured.err and "validation reward" in captured.err
    assert summary["train"]["episodes"] == 12  # the final figures cover every training item
    assert load_policy_file(tmp_path / "run" / "policy").controller == "learned"

    bad = ["train", "--model", "tiny-random", "--out", "x", "--no-register"]
    assert tune_main([*bad, "--algo", "ppo", "--timesteps", "8", "--validation-fraction", "1"]) == 2
    assert "--validation-fraction must be at least 0 and below 1" in capsys.readouterr().err
    assert tune_main([*bad, "--algo", "optuna", "--trials", "1", "--validation-fraction", "0.3"]) == 2
    assert "--validation-fraction is for ppo or sac" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("algo", "action", "schedule"),
    [("ppo", "budget", "linear"), ("ppo", "budget", "constant"), ("sac", "knobs", "linear")],
)
def test_lr_schedule_reaches_the_optimisers_and_is_recorded(tmp_path, monkeypatch, capsys, algo, action, schedule):
    """``--lr-schedule linear`` decays the optimisers' learning rate to zero over the run (SB3's progress_remaining:
    PPO's 3 updates here at 2/3, 1/3 and 0 of the start), ``constant`` leaves it; the saved model's optimisers hold
    the rate of the last update, and the schedule is a run parameter and in the export's ``policy.json``."""
    import mlflow
    from stable_baselines3 import PPO, SAC

    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", algo, "--action", action, "--model", "tiny-random", "--timesteps", "96" if algo == "ppo"
            else "32", "--n-envs", "2", "--eval-every", "0", "--learning-rate", "2e-3", "--lr-schedule", schedule,
            "--out", "run", "--no-register"]  # fmt: skip
    _, _, run, _ = _train_run(args, capsys)
    model = (PPO if algo == "ppo" else SAC).load(str(tmp_path / "run" / f"{algo}_sb3.zip"), device="cpu")
    optimisers = [model.policy.optimizer] if algo == "ppo" else [model.actor.optimizer, model.critic.optimizer]
    last = {group["lr"] for opt in optimisers for group in opt.param_groups}
    assert last == ({2e-3} if schedule == "constant" else {0.0})  # SB3 sets the float the schedule returns
    if algo == "ppo":  # SB3 dumps an update's figures before the next one: the last update's are not logged
        history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "train/learning_rate")
        rates = [m.value for m in sorted(history, key=lambda m: m.step)]
        start = [1.0, 1.0] if schedule == "constant" else [2 / 3, 1 / 3]
        assert rates == [pytest.approx(2e-3 * f) for f in start]
    assert run.data.params["preset_lr_schedule"] == schedule and run.data.params["preset_learning_rate"] == "0.002"
    doc = json.loads((tmp_path / "run" / "policy" / "policy.json").read_text())
    assert (doc["lr_schedule"], doc["learning_rate"]) == (schedule, 2e-3)
    bad = ["train", "--model", "tiny-random", "--out", "x", "--no-register"]
    assert tune_main([*bad, "--algo", "optuna", "--trials", "1", "--lr-schedule", "linear"]) == 2
    assert "--lr-schedule are for ppo or sac" in capsys.readouterr().err


def test_eval_and_compare_are_mlflow_runs_and_errors(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"  # absolute: MLflow keeps one store per URI string per process
    args = ["eval", "default", "--model", "tiny-random", "--workload", "prose", "--split", "heldout"]
    assert tune_main([*args, "--tracking-uri", uri]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["controller"] == "dynamic" and 0 < doc["kv_fraction"] <= 1 and doc["ppl"] > 1
    args = ["compare", "--model", "tiny-random", "--workload", "prose", "--policy", "again=default", "--out", "cmp"]
    assert tune_main([*args, "--tracking-uri", uri]) == 0
    capsys.readouterr()
    import mlflow

    mlflow.set_tracking_uri(uri)
    runs = {r.data.tags["confkv.kind"]: r for r in mlflow.search_runs(experiment_names=["confkv-tune"],
                                                                       output_format="list")}  # fmt: skip
    assert set(runs) == {"eval", "compare"}
    assert runs["eval"].data.metrics["kv_fraction"] == pytest.approx(doc["kv_fraction"])
    assert runs["eval"].data.params["split"] == "heldout" and runs["eval"].data.tags["confkv.git_commit"]
    assert runs["compare"].data.metrics["again.kv_fraction"] == pytest.approx(doc["kv_fraction"])
    assert "window.kl_mean" in runs["compare"].data.metrics
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(runs["compare"].info.run_id)}
    assert {"compare.md", "compare.json", "compare.png"} <= artifacts

    assert tune_main(["eval", "nonsense", "--model", "tiny-random", "--no-mlflow"]) == 2
    assert "neither a file" in capsys.readouterr().err
    assert tune_main(["eval", "calibrated", "--model", "tiny-random", "--no-mlflow"]) == 2
    assert "confkv calibrate" in capsys.readouterr().err
    assert tune_main(["train", "--algo", "ppo", "--trials", "3", "--model", "tiny-random", "--out", "x"]) == 2
    assert tune_main(["train", "--algo", "ppo", "--scorer", "h2o,tova", "--model", "tiny-random", "--out", "x"]) == 2
    assert "optuna only" in capsys.readouterr().err
    assert tune_main(["eval", "default", "--model", "tiny-random", "--workload", "poetry", "--no-mlflow"]) == 2


def test_ppo_presets_make_tens_of_updates(capsys):
    from agents.sb3 import PRESETS, schedule
    from tuner.cli import PRESET_NAMES

    assert tuple(PRESETS) == PRESET_NAMES
    quick = schedule("ppo", PRESETS["quick"].timesteps, PRESETS["quick"].n_envs, PRESETS["quick"])
    assert quick == {"updates": 32, "rollout_steps": 64, "minibatches": 2, "gradient_steps": 640, "timesteps_run": 2048}
    standard = PRESETS["standard"]
    assert schedule("ppo", standard.timesteps, standard.n_envs, standard)["updates"] == 32
    refine = PRESETS["refine"]  # quick's schedule, gentler steps, relative rewards
    assert schedule("ppo", refine.timesteps, refine.n_envs, refine) == quick
    assert refine.relative_reward and refine.learning_rate < PRESETS["quick"].learning_rate
    assert refine.log_std_init < PRESETS["quick"].log_std_init
    decode = ["train", "--algo", "ppo", "--model", "tiny-random", "--preset", "refine", "--mode", "decode",
              "--out", "x", "--no-register"]  # fmt: skip
    assert tune_main(decode) == 2
    assert "teacher mode only" in capsys.readouterr().err


def test_train_ppo_in_decode_mode(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", "ppo", "--mode", "decode", "--model", "tiny-random", "--timesteps", "24", "--out", "d"]
    assert tune_main(args) == 0
    assert load_policy_file(tmp_path / "d" / "policy").controller == "learned"
    capsys.readouterr()
    # the export would be chosen by teacher-forced evaluations, a reward the decode agent does not train on
    assert tune_main([*args, "--keep", "best"]) == 2
    assert "--keep last" in capsys.readouterr().err


def test_optuna_refuses_to_resume_a_study_under_other_settings(tmp_path, monkeypatch, capsys):
    """The study name says model, workload and objectives only: a resume with another reward, another item seed or
    scale is refused before the model loads, naming what differs; the same settings resume the study."""
    import optuna

    monkeypatch.chdir(tmp_path)
    args = ["train", "--algo", "optuna", "--model", "tiny-random", "--workload", "prose", "--trials", "1",
            "--out", "run", "--no-register"]  # fmt: skip
    _, _, run, _ = _train_run(args, capsys)
    storage, name = run.data.tags["confkv.optuna_storage"], run.data.tags["confkv.optuna_study"]
    assert optuna.load_study(study_name=name, storage=storage).user_attrs["confkv_settings"]["quality_weight"] == 2.0
    assert tune_main([*args, "--quality-weight", "3"]) == 2
    err = capsys.readouterr().err
    assert "was created with other settings: --quality-weight 2.0 (now 3.0)" in err
    assert "--study NAME, --storage URL or another --out" in err
    assert tune_main([*args, "--seed", "1", "--items-scale", "2", "--scorer", "h2o"]) == 2
    err = capsys.readouterr().err
    assert "--seed 0 (now 1); --items-scale 1 (now 2); --scorer snapkv (now h2o)" in err
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 1  # nothing ran
    _train_run([*args, "--scorer", "snapkv"], capsys)  # the default scorer named: the same settings
    assert len(optuna.load_study(study_name=name, storage=storage).trials) == 2
    # another study name in the same storage starts afresh under the new reward
    _, _, other, _ = _train_run([*args, "--quality-weight", "3", "--study", "q3"], capsys)
    assert other.data.tags["confkv.optuna_trials"] == "1"
