"""The rollout inspector: what the policy wrote, recorded during training and browsed offline.

- ``samples.py``: ``RUN_DIR/samples.jsonl``, its config (``log.samples.*``), size cap, resume and reader.
- ``record.py``: turns a step's scored groups and trained batch (and the greedy evaluation) into records.
- ``page.py``: ``tidal inspect RUN_DIR ...`` writes one self-contained ``inspect.html`` (rollout browser,
  prompt history, metric curves of several runs, config diff); ``assets/`` holds its script and style.
- ``serve.py``: the optional local server (loopback only).
"""
