"""Scale-out on Ray Serve: ``confkv serve --replicas N`` (docs/scaling-out.md).

Only ``options`` is imported without ``--replicas``; every other module here imports Ray, which is an optional
dependency (``confkv[ray]``), so nothing here is imported by ``import confkv`` or a plain ``confkv serve``.
"""
