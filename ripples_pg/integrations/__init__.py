"""Training frameworks over ``ripples_pg.training``: PyTorch Lightning (``lightning``, with
``_pl_progress``, ``_pl_checkpoint``, ``_pl`` and ``_pl_autoregister``) and Hugging Face
(``hf``). Each imports its framework, an optional dependency, when it is imported itself;
nothing is imported here.
"""
