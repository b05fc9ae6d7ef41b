"""Distillation: a student learns from a teacher model, with the same data contracts as RL.

- ``traces``: the teacher samples N responses per prompt with the rollout engine, a tidal reward keeps the
  verified ones (rejection sampling), the student is trained on them with supervised next-token loss
  (Magistral Small's SFT on Magistral Medium's traces, arXiv 2506.10910).
- ``logits``: the teacher's top-k next-token distribution at every response position is stored in
  compact safetensors shards and the student trained with forward KL to it (Gemini 2.5's k-sparse
  distillation, arXiv 2507.06261), or to the full distribution computed on the fly.
- on-policy (``teacher.TeacherScorer``): in the RL loop the teacher scores the student's own samples,
  token by token, in the scorer thread; the loss is the per-token reverse KL (``algo/distill.py``).
- ``system/run.teacher_path``: the quickstart's teacher, a larger tiny model tidal trains and caches itself.
"""
