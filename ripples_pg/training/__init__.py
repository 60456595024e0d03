"""Training over a ``ripples`` group: ``wrap()`` (``_wrap``) and what it links -- the training
options' table (``_args``), the DDP comm hook (``hooks``), the averagers (``averager``,
``diloco``, ``overlap``), job-wide progress (``progress``, ``sampler``, ``lr``), checkpoints
(``checkpoint``) and the what-if arithmetic (``whatif``).

Imports the backend layer below it, never ``integrations`` or ``tools``; nothing is imported
here (``ripples_pg.wrap`` and its siblings load on first use, see ripples_pg/__init__.py).
"""
