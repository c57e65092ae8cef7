"""envs: the gymnasium environments in which cache policies are learned and judged.

* ``envs.env``: ``ConfKVEnv`` (one episode) and ``ConfKVVecEnv`` (N episodes as one engine batch, what
  stable-baselines3 trains on). An episode is one workload item scored teacher-forced through the engine, a step one
  segment of ``compact_interval`` tokens; the action sets the dynamic rule's five knobs (or the budget directly), and
  the reward is memory saved minus weighted KL to the full cache, plus a task reward on retrieval episodes.
* ``envs.decode_env``: ``ConfKVDecodeEnv``, the same observations and actions over free decoding, where quality is
  the divergence from the full cache's own answer (``confkv-tune train --mode decode``).
* ``envs.episodes``: the training and held-out episodes (workload items with their full-cache references), their
  sizes per model and ``--items-scale``, and ``hold_out``, the share of training items that chooses an agent's export.
* ``envs.evaluate``: one evaluation for every policy and agent (resident KV, KL, perplexity, retrieval accuracy and
  the reward), and the base policy's per-segment rewards that ``--relative-reward`` subtracts.

``agents`` trains and exports learners in these environments; ``tuner`` runs the Optuna search, ``confkv-tune`` and
the registry's gate on them.
"""
