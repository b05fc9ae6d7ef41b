"""How a run's processes are started beyond one: under torchrun (FSDP2 or DiLoCo ranks, ``torchrun.py``) and as
elastic replicas without torchrun (``elastic.py``). A one-process run is ``system/run.py``'s ``train``."""
