"""Data parallelism: FSDP2 (``fsdp.py``), DiLoCo (``diloco*.py``), elastic replicas (``elastic*.py``,
``replica_group.py``); ``tidal/launch/`` starts their processes. The trainer sees only the rank group it is handed
(``train/data_parallel.py``), so nothing in ``train/`` imports this package."""
